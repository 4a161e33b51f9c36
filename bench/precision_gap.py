"""The canary's trainer–engine log-prob gap in each precision pair, against its threshold.

    python bench/precision_gap.py [--config configs/tiny_cpu.yaml] [--steps 5]
        [--engines float32 bfloat16] [--trainers 32-true bf16-mixed] [--threads 1]

Each pair (the vLLM engine's dtype × `trainer.precision`) runs `fit` of `--config` for
`--steps` steps in a process of its own, the canary measuring but not stopping
(`model.max_logprob_gap: null`), so a gap over the threshold is measured, not cut short. The
table gives, per pair, the mean and the largest of the per-step mean gaps (|engine − trainer|
log-probs of the sampled tokens, before the update), the largest single-token gap, the pair's
default threshold (`canary.default_max_logprob_gap`), and the margin: threshold / largest
per-step mean (how far a healthy run stays below a stop). A margin below 1 (the default would
stop a healthy run) or a run that fails (its last line, as an error row) makes the bench exit 1.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def gaps(run_dir: str) -> tuple[list[float], list[float]]:
    """The per-step `rollout/logprob_gap_mean` and `rollout/logprob_gap_max` of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(glob.glob(os.path.join(run_dir, "**", "events.*"), recursive=True))
    acc = EventAccumulator(events[-1], size_guidance={"scalars": 0})
    acc.Reload()
    return tuple(  # type: ignore[return-value]
        [e.value for e in acc.Scalars(tag)]
        for tag in ("rollout/logprob_gap_mean", "rollout/logprob_gap_max")
    )


def run_pair(config: str, engine: str, trainer: str, steps: int, threads: int) -> tuple[str, float]:
    """One row of the table (`fit` at this pair, its gaps against its threshold) and its margin
    (threshold / worst step's mean; 0 for a run that failed)."""
    from composer_lightning.training.canary import default_max_logprob_gap

    threshold = default_max_logprob_gap(trainer, engine)
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, "-m", "composer_lightning", "fit", "--config", config,
            f"--trainer.max_steps={steps}", f"--trainer.precision={trainer}",
            f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.limit_val_batches=0",
            "--rollout.init_args.val_before_train=false",
            "--rollout.init_args.samples_every_n_steps=0",
            f"--rollout.init_args.engine.init_args.dtype={engine}",
            "--model.max_logprob_gap=null",  # measured, compared below, never a stop
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
            return f"| {engine} | {trainer} | error: {last} | | | {threshold:g} | |", 0.0
        means, maxima = gaps(out)
    worst = max(means)
    margin = threshold / worst if worst else float("inf")
    shown = f"{margin:.3g}" if margin < 100 else f"{margin:.0f}"  # 0.767, 3.08, 162
    return (
        f"| {engine} | {trainer} | {sum(means) / len(means):.2e} | {worst:.2e} | "
        f"{max(maxima):.2e} | {threshold:g} | {shown}× |"
    ), margin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engines", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--trainers", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"{args.config}, {args.steps} steps a pair, {args.threads} thread(s)")
    print(
        "\n| engine | trainer | gap mean | worst step's mean | worst token | threshold | margin |"
    )
    print("|---|---|---|---|---|---|---|")
    failed = False
    for engine in args.engines:
        for trainer in args.trainers:
            row, margin = run_pair(args.config, engine, trainer, args.steps, args.threads)
            failed |= margin < 1  # a failed run's margin is 0
            print(row, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

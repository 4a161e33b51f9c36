"""Does the main job learn? Mean rollout reward of the last 20 steps vs the first 20, per seed.

Runs `python -m composer_lightning fit --config <config>` once per seed (each in its own
process, one thread), reads `rollout/reward_mean` from the TensorBoard logs and prints, per seed
and pooled, first-20 mean, last-20 mean, their difference, the difference in standard errors,
and wall time:

    OMP_NUM_THREADS=1 .venv/bin/python bench/learning.py --config configs/tiny_cpu.yaml --seeds 0 1 2

The criterion printed at the end: last-20 exceeds first-20 by >= 0.2 and by > 3 standard errors
(of the difference of the two 20-step means, from the per-step variation) on every seed.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rewards(logdir: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(logdir, "**", "events.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    return [e.value for e in acc.Scalars("rollout/reward_mean")]


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)
    return m, math.sqrt(var / len(xs))


def run(config: str, seed: int, extra: list[str]) -> tuple[list[float], float]:
    """One seed's fit in its own process: its per-step mean rollout reward and wall time (its
    logs and checkpoints go to a temporary directory, removed once read)."""
    with tempfile.TemporaryDirectory(prefix=f"learning_s{seed}_") as out:
        cmd = [
            sys.executable,
            "-m",
            "composer_lightning",
            "fit",
            "--config",
            config,
            f"--seed_everything={seed}",
            f"--data.init_args.seed={seed}",
            f"--trainer.default_root_dir={out}",
            f"--trainer.logger.init_args.save_dir={out}",
            *extra,
        ]
        start = time.perf_counter()
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"seed {seed} failed:\n{proc.stderr[-4000:]}")
        return rewards(out), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("extra", nargs="*", help="more CLI overrides, after --")
    args = ap.parse_args()
    w = args.window
    print(f"config: {args.config}   window: {w} steps   seeds: {args.seeds}")
    print(f"| seed | steps | first-{w} mean | last-{w} mean | Δ | Δ / SE | wall s |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for seed in args.seeds:
        r, wall = run(args.config, seed, args.extra)
        (m0, s0), (m1, s1) = mean_se(r[:w]), mean_se(r[-w:])
        se = math.sqrt(s0**2 + s1**2)
        z = (m1 - m0) / se if se > 0 else float("inf")
        ok &= (m1 - m0 >= 0.2) and z > 3
        print(
            f"| {seed} | {len(r)} | {m0:.3f} | {m1:.3f} | {m1 - m0:+.3f} | {z:.1f} | {wall:.0f} |"
        )
    print(f"criterion (Δ ≥ 0.2 and Δ/SE > 3 on every seed): {'MET' if ok else 'NOT MET'}")


if __name__ == "__main__":
    main()

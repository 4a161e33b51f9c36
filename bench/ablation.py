"""What does composition buy? Five head sets × seeds × two tasks, judged on held-out prompts.

    python bench/ablation.py [--quick] [--seeds 0 1 2] [--steps 200] [--jobs 2]

Every run is `python -m composer_lightning fit --config configs/tiny_cpu.yaml` (the tiny
offline policy, vLLM on CPU, G = 4, 8 prompts per step) with only the heads changed:
- `rl_only`: Dr. GRPO;
- `opd_only`: OPD (the policy given the verifier's hint as teacher);
- `combine`: OpenClaw-RL's combine, Dr. GRPO + OPD in one clipped surrogate;
- `grpo_sdpo`: Dr. GRPO + SDPO (hinted self-distillation);
- `all_four`: Dr. GRPO + OPD + SDPO + replay DPO (the main job).
Each head keeps its weight of the main job (Dr. GRPO 1, OPD 0.5, SDPO 0.1 warmed up over 20
steps, replay DPO 0.05), so variants differ only in which signals are present. Two tasks:
- `main`: a + b with operands 0–20 at temperature 1 (the policy starts near 60 % correct);
- `sparse`: only the sums with a units carry (`Arithmetic(carry_only=True)`), at temperature
  0.6: the policy's weak spot, ≈ 6 % correct sampled and 0 % greedy, ≈ 96 % with the hint in
  context (`arithmetic_carry/` in the tiny policy's build_info.json).
The main task runs 200 steps with held-out evaluation every 25; the sparse task, which moves
within its first steps, 60 steps with evaluation every 5 (greedy accuracy, pass@4 and response
length on held-out prompts, disjoint from the training stream by construction).

Prints per task: held-out greedy accuracy at the end (mean ± standard error over seeds) and
pass@4, the first evaluation step at which each seed's greedy accuracy reached the threshold
(mean over the seeds that did, and how many did), the mean training reward of the last 20
steps, and wall time; writes docs/ablation.png (held-out greedy accuracy against step).
`--quick`: one seed, 60 and 30 steps (a few minutes).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

H = "composer_lightning.heads."
HEADS = {
    "dr_grpo": {"class_path": H + "dr_grpo.DrGRPOHead", "init_args": {"weight": 1.0}},
    "opd": {"class_path": H + "opd.OPDHead", "init_args": {"weight": 0.5}},
    "sdpo": {"class_path": H + "sdpo.SDPOHead", "init_args": {"weight": 0.1, "warmup_steps": 20}},
    "replay_dpo": {
        "class_path": H + "replay_dpo.ReplayDPOHead",
        "init_args": {"weight": 0.05, "capacity": 256, "pairs_per_step": 4},
    },
}
VARIANTS = {
    "rl_only": ["dr_grpo"],
    "opd_only": ["opd"],
    "combine": ["dr_grpo", "opd"],
    "grpo_sdpo": ["dr_grpo", "sdpo"],
    "all_four": ["dr_grpo", "opd", "sdpo", "replay_dpo"],
}
TASKS = {  # steps and evaluation interval per task: the sparse task moves in its first steps
    "main": {"args": [], "threshold": 0.85, "steps": 200, "val_every": 25, "quick": (60, 20)},
    "sparse": {
        "args": [
            "--data.init_args.task_args={carry_only: true}",
            "--rollout.sampling.temperature=0.6",
        ],
        "threshold": 0.8,
        "steps": 60,
        "val_every": 5,
        "quick": (30, 5),
    },
}


def run(task: str, variant: str, seed: int, quick: bool, out: str) -> dict:
    steps, val_every = (
        TASKS[task]["quick"] if quick else (TASKS[task]["steps"], TASKS[task]["val_every"])
    )
    heads = json.dumps([HEADS[h] for h in VARIANTS[variant]])
    cmd = [
        sys.executable, "-m", "composer_lightning", "fit",
        "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"--model.heads={heads}", *TASKS[task]["args"],
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}",
        f"--seed_everything={seed}", f"--rollout.sampling.seed={seed}",
        f"--rollout.engine.init_args.seed={seed}", f"--data.init_args.seed={seed}",
        "--rollout.samples_every_n_steps=0", "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]", f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{task}/{variant}/seed {seed} failed:\n{proc.stderr[-3000:]}")
    curves = scalars(out)
    # evaluation i ran after (i + 1) * val_every rollout batches (= optimizer steps here)
    curves["val/accuracy"] = [
        ((i + 1) * val_every, v) for i, (_, v) in enumerate(curves["val/accuracy"])
    ]
    return {"task": task, "variant": variant, "seed": seed, "wall": wall, **curves}


def scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(logdir, "**", "events.*"), recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    keep = [
        t for t in tags if t.startswith("val/") or t == "rollout/reward_mean" or t == "sdpo/jsd"
    ]
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in keep}


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def report(results: list[dict], seeds: list[int]) -> list[str]:
    lines = []
    for task in TASKS:
        thr = TASKS[task]["threshold"]
        lines += [
            f"\n{task} task — held-out greedy accuracy after the last step (mean ± SE over "
            f"{len(seeds)} seed(s)); first evaluated step with greedy accuracy ≥ {thr:.2f}:",
            "| variant | greedy acc | pass@4 | steps to threshold (seeds reached) | "
            "train reward, last 20 | wall s |",
            "|---|---|---|---|---|---|",
        ]
        for variant in VARIANTS:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            acc = mean_se([r["val/accuracy"][-1][1] for r in rs])
            p4 = mean_se([r["val/pass@4"][-1][1] for r in rs])
            reached = [next((s for s, v in r["val/accuracy"] if v >= thr), None) for r in rs]
            hit = [s for s in reached if s is not None]
            steps = (
                f"{sum(hit) / len(hit):.0f} ({len(hit)}/{len(rs)})" if hit else f"— (0/{len(rs)})"
            )
            reward = mean_se([sum(v for _, v in r["rollout/reward_mean"][-20:]) / 20 for r in rs])
            wall = sum(r["wall"] for r in rs) / len(rs)
            lines.append(
                f"| {variant} | {acc[0]:.3f} ± {acc[1]:.3f} | {p4[0]:.3f} ± {p4[1]:.3f} | "
                f"{steps} | {reward[0]:.3f} ± {reward[1]:.3f} | {wall:.0f} |"
            )
    return lines


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(12, 4.5), sharey=True)
    for ax, task in zip(axes, TASKS, strict=True):
        for variant in VARIANTS:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            steps = [s for s, _ in rs[0]["val/accuracy"]]
            curves = [[v for _, v in r["val/accuracy"]] for r in rs]
            stats = [mean_se([c[i] for c in curves]) for i in range(len(steps))]
            mean = [m for m, _ in stats]
            se = [0.0 if math.isnan(s) else s for _, s in stats]
            ax.plot(steps, mean, marker="o", label=variant)
            ax.fill_between(
                steps,
                [m - s for m, s in zip(mean, se, strict=True)],
                [m + s for m, s in zip(mean, se, strict=True)],
                alpha=0.15,
            )
        ax.axhline(TASKS[task]["threshold"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{task} task: held-out greedy accuracy", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy accuracy (mean ± SE over seeds)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, fewer steps")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--png", default=str(ROOT / "docs" / "ablation.png"))
    ap.add_argument("--json", default=None, help="also write every run's curves here")
    args = ap.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
    jobs = [(t, v, s) for t in args.tasks for v in args.variants for s in args.seeds]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, t, v, s, args.quick, f"{tmp}/{t}_{v}_{s}") for t, v, s in jobs]
        results = [f.result() for f in futures]
    total = time.perf_counter() - start
    plan = ", ".join(
        f"{t}: {TASKS[t]['quick'][0] if args.quick else TASKS[t]['steps']} steps"
        for t in args.tasks
    )
    print(
        f"configs/tiny_cpu.yaml ({plan}), seeds {args.seeds}, {args.jobs} runs at a time, "
        f"{total / 60:.1f} min"
    )
    print("\n".join(report(results, args.seeds)))
    plot(results, Path(args.png))
    print(f"\nwrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

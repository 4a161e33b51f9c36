"""What does composition buy? Head sets × seeds × tasks, on held-out prompts.

    python bench/ablation.py [--quick] [--seeds 0 1 2] [--steps 50] [--jobs 2]
        [--tasks carry subtract multiply tool] [--variants rl_only combine ...]
        [--weights sdpo=1.0 opd=0.5] [--sdpo-clip-mode scale] [--head-args opd.gap_clip=1.0]
        [--fit-arg=--rollout.max_staleness=2 ...]

Every run of a suite task is `python -m composer_lightning fit --config configs/tiny_cpu.yaml`
(the tiny offline policy, vLLM on CPU, G = 4, 8 prompts per step, AdamW 1e-4) with only the
heads and the task changed. Variants (`VARIANTS`):
- `rl_only`: Dr. GRPO;
- `opd`: OPD alone (the policy given the verifier's hint as teacher);
- `topk_opd`: top-k OPD alone (the hint chosen among `--candidates` candidate hints per sample,
  `--rollout.hint.init_args.candidates`);
- `combine`: OpenClaw-RL's combine, Dr. GRPO + OPD in one clipped surrogate;
- `grpo_sdpo`: Dr. GRPO + SDPO (hinted self-distillation);
- `all`: the main job's four heads, Dr. GRPO + OPD + SDPO + replay DPO. Top-k OPD is not in
  it: it is another estimate of the same teacher advantage as OPD (the teacher given a chosen
  hint), and both in one objective would count the teacher twice; `all_topk` (top-k OPD in
  OPD's place) is there to ask for by name;
- `combine_sdpo`: Dr. GRPO + OPD + SDPO (the tool config's heads);
- `<variant>_placebo` for each variant with a hint head (`combine_placebo`, …): the same heads
  with every hint another problem's (`rollout.hint_placebo`), the control that shows a gain
  comes from what the hint says and not from the extra teacher signal.
Each head has one weight in every variant it is in (`WEIGHTS`, overridable with `--weights`),
so variants differ only in which signals are present; other head arguments are the heads'
defaults unless `HEAD_ARGS` or `--head-args HEAD.ARG=VALUE` (a YAML value) set them. A task may
have weights and head arguments of its own (`TASK_WEIGHTS`, `TASK_HEAD_ARGS`, over the
defaults); `--weights` and `--head-args` override both, for every task run.

Tasks (`TASKS`): the sparse-reward suite (`composer_lightning/tasks/suite.py`: task, task
arguments and training temperature each; `bench/sparse_suite.py` measures them), the default of
`--tasks`; and `tool`, asked for by name (`--tasks tool`): the tool agent of
`configs/tool_agent_cpu.yaml` as it is (the tiny tool policy, `tool_calc` through episodes of up
to 3 turns at temperature 0.7, the tool's error as the hint of the turn that caused it), only
the heads changed. Its default variants are `TOOL_VARIANTS` (`rl_only`, `opd`, `combine`,
`combine_sdpo`), its weights the config's (every head at 1, OPD's gap clip 1.0, SDPO without
warm-up), and its start figures and threshold come from the policy's `build_info.json` (greedy
episode success alone and with the error-derived hint). It is not in the default because a run
of it costs several times one of the suite's (3-turn episodes of up to 32 tokens a turn). Every
task: `STEPS` optimizer steps (`--steps` for all), held-out evaluation every 5 steps (greedy
accuracy — for `tool`, greedy episode success — and pass@4 on held-out prompts, disjoint from
the training stream by construction); the configs' checkpoint callbacks and sample files are
turned off.

Prints per task the held-out greedy accuracy at steps 5, 10, 20, 50 (those before the last) and
at the end (mean ± SE over seeds; in brackets the difference to `rl_only` in units of the
standard error of the difference, `(m − m_rl) / sqrt(se² + se_rl²)`, seeds taken as independent:
conservative, since a seed's runs share its prompt stream), the first evaluated step at
which each seed's accuracy reached the task's threshold (what the hinted policy solves greedily
at the start, `hinted_greedy`, capped at 0.9: when the student alone does what its teacher did;
mean over the seeds that did, and how many), the mean training reward of the last 10 steps,
and wall time per run; writes docs/ablation.png (one panel per task; `--png` elsewhere, e.g.
docs/ablation_tool.png for `--tasks tool`). `--quick`: one seed, 10 steps (an end-to-end check).
`--fit-arg=--KEY=VALUE` (repeatable) adds an override to every run's fit, e.g.
`--fit-arg=--rollout.max_staleness=2`. The suite's runs read the composition options
`configs/tiny_cpu.yaml` states (the hint check, the teacher below the group's mean, the cap with
`teacher_alone: 0`: the main job's, as measured), at which a teacher never acts where every reply
is wrong; `--fit-arg=--rollout.teacher_replies=below_teacher --fit-arg=--model.teacher_alone=0.2`
runs at the library's defaults, where a right teacher acts there. The tables of
docs/benchmarks/ablation.md were measured before any of them, and
`--fit-arg=--rollout.hint_trust=always --fit-arg=--rollout.teacher_replies=all
--fit-arg=--model.teacher_cap=null` runs as they were.

Why this file is long: one benchmark from its table of tasks and head sets to the runs, the
report and the plot; each part reads the others' records, and a bench is a script a user reads
top to bottom.
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
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from composer_lightning.tasks.suite import SUITE  # noqa: E402

# Head weights, one per head in every variant (defaults to be set from measurements).
WEIGHTS = {"dr_grpo": 1.0, "opd": 0.5, "topk_opd": 0.5, "sdpo": 0.1, "replay_dpo": 0.05}
H = "composer_lightning.heads."
HEAD_CLASSES = {
    "dr_grpo": H + "dr_grpo.DrGRPOHead",
    "opd": H + "opd.OPDHead",
    "topk_opd": H + "topk_opd.TopKOPDHead",
    "sdpo": H + "sdpo.SDPOHead",
    "replay_dpo": H + "replay_dpo.ReplayDPOHead",
}
# Arguments other than the weight; anything left out is the head's default.
HEAD_ARGS: dict[str, dict] = {
    "dr_grpo": {},
    "opd": {},
    "topk_opd": {"k": 4, "subset": "student", "selection": "sequence_optimal", "gap_clip": 1.0},
    "sdpo": {"warmup_steps": 20},
    "replay_dpo": {"capacity": 256, "pairs_per_step": 4},
}
VARIANTS = {
    "rl_only": ["dr_grpo"],
    "opd": ["opd"],
    "topk_opd": ["topk_opd"],
    "combine": ["dr_grpo", "opd"],
    "grpo_sdpo": ["dr_grpo", "sdpo"],
    "all": ["dr_grpo", "opd", "sdpo", "replay_dpo"],
    "all_topk": ["dr_grpo", "topk_opd", "sdpo", "replay_dpo"],
    "combine_sdpo": ["dr_grpo", "opd", "sdpo"],
}
# The placebo of each variant with a hint head: the same heads, every hint another problem's
# (`rollout.hint_placebo`): what the variant gains beyond it is what its hints say.
PLACEBO = "_placebo"
VARIANTS |= {
    f"{v}{PLACEBO}": h for v, h in VARIANTS.items() if set(h) & {"opd", "topk_opd", "sdpo"}
}
DEFAULT_VARIANTS = ["rl_only", "opd", "topk_opd", "combine", "grpo_sdpo", "all"]
TOOL_VARIANTS = ["rl_only", "opd", "combine", "combine_sdpo"]
NEEDS_CANDIDATES = {"topk_opd"}  # heads that select among several candidate hints
# Sized to the budget: two at a time on 2 cores a run takes ≈ 27 s + 0.25 s per step (≈ 2× that
# while others load the cores), so the default 54 runs take ≈ 19 min; carry moves within its
# first 20 steps, the others slowly.
STEPS = {"carry": 50, "subtract": 60, "multiply": 60, "tool": 30}
VAL_EVERY = 5
REPORT_STEPS = (5, 10, 20, 50)
QUICK_STEPS = 10


@dataclass(frozen=True)
class BenchTask:
    """A task of this benchmark: the config its runs start from and what is reported.

    Attributes:
        config: the config under `configs/`.
        fit_args: overrides of the config that make it this task.
        describe: the report header's description (task, arguments, temperature).
        temperature: the training temperature (the plot's panel title).
        plain_greedy, hinted_greedy: the policy's greedy success at the start, alone and with
            the hint in context.
        variants: the variants run when `--variants` is not given.
        hints_candidates: whether the hint provider takes `candidates` (top-k OPD).
    """

    config: str
    describe: str
    temperature: float
    plain_greedy: float
    hinted_greedy: float
    fit_args: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    hints_candidates: bool = True


def _tool_task() -> BenchTask:
    config = yaml.safe_load((ROOT / "configs" / "tool_agent_cpu.yaml").read_text())
    rollout = config["rollout"]["init_args"]
    info = json.loads((ROOT / config["model"]["policy"] / "build_info.json").read_text())
    return BenchTask(
        config="tool_agent_cpu.yaml",
        describe=f"{config['data']['init_args']['task']}, up to {rollout['max_turns']} turns, "
        f"tool errors as hints, temperature {rollout['sampling']['temperature']}",
        temperature=rollout["sampling"]["temperature"],
        plain_greedy=info["tool_calc/greedy/plain/success"],
        hinted_greedy=info["tool_calc/greedy/hinted/success"],
        variants=list(TOOL_VARIANTS),
        hints_candidates=False,  # ToolErrorHint: one hint, the error
    )


TASKS: dict[str, BenchTask] = {
    **{
        name: BenchTask(
            config="tiny_cpu.yaml",
            describe=f"{e.task} {json.dumps(e.task_args)}, temperature {e.temperature}",
            temperature=e.temperature,
            plain_greedy=e.figures["plain_greedy"],
            hinted_greedy=e.figures["hinted_greedy"],
            fit_args=e.fit_args(),
        )
        for name, e in SUITE.items()
    },
    "tool": _tool_task(),
}
# Weights and head arguments of a task's own, over WEIGHTS and HEAD_ARGS: the tool config's.
TASK_WEIGHTS: dict[str, dict[str, float]] = {"tool": {"dr_grpo": 1.0, "opd": 1.0, "sdpo": 1.0}}
TASK_HEAD_ARGS: dict[str, dict[str, dict]] = {
    "tool": {"opd": {"gap_clip": 1.0}, "sdpo": {"warmup_steps": 0}}
}


def threshold(task: str) -> float:
    """The held-out accuracy a run has to reach: what the hinted policy solved greedily at the
    start, capped at 0.9."""
    return min(0.9, TASKS[task].hinted_greedy)


def heads_json(variant: str, weights: dict[str, float], head_args: dict[str, dict]) -> str:
    return json.dumps(
        [
            {"class_path": HEAD_CLASSES[h], "init_args": {"weight": weights[h], **head_args[h]}}
            for h in VARIANTS[variant]
        ]
    )


def run(task: str, variant: str, seed: int, steps: int, cfg: dict, out: str) -> dict:
    extra = list(TASKS[task].fit_args)
    if NEEDS_CANDIDATES & set(VARIANTS[variant]):
        extra.append(f"--rollout.hint.init_args.candidates={cfg['candidates']}")
    if variant.endswith(PLACEBO):
        extra.append("--rollout.hint_placebo=true")
    cmd = [
        sys.executable, "-m", "composer_lightning", "fit",
        "--config", str(ROOT / "configs" / TASKS[task].config),
        f"--model.heads={heads_json(variant, cfg['weights'], cfg['head_args'])}", *extra,
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={VAL_EVERY}",
        f"--seed_everything={seed}", f"--rollout.sampling.seed={seed}",
        f"--rollout.engine.init_args.seed={seed}", f"--data.init_args.seed={seed}",
        "--rollout.samples_every_n_steps=0", "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]", f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}", *cfg.get("fit_args", []),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{task}/{variant}/seed {seed} failed:\n{proc.stderr[-3000:]}")
    curves = scalars(out)
    for tag in [t for t in curves if t.startswith("val/")]:
        # evaluation i ran after (i + 1) * VAL_EVERY rollout batches (= optimizer steps here)
        curves[tag] = [((i + 1) * VAL_EVERY, v) for i, (_, v) in enumerate(curves[tag])]
    return {"task": task, "variant": variant, "seed": seed, "steps": steps, "wall": wall, **curves}


def scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(logdir, "**", "events.*"), recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    keep = [
        t
        for t in acc.Tags()["scalars"]
        if t.startswith(("val/", "dispatch/")) or t in ("rollout/reward_mean", "sdpo/jsd")
    ]
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in keep}


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def accuracy_at(r: dict, step: int | None) -> float | None:
    """Held-out greedy accuracy of run `r` at `step` (None: its last evaluation)."""
    curve = r["val/accuracy"]
    if step is None:
        return curve[-1][1] if curve else None
    return next((v for s, v in curve if s == step), None)


def cell(rs: list[dict], base: list[dict] | None, step: int | None) -> str:
    """`mean ± SE [difference to the baseline runs in units of its SE]` at `step`."""
    values = [accuracy_at(r, step) for r in rs]
    if not rs or None in values:
        return "—"
    m, se = mean_se(values)
    text = f"{m:.3f} ± {se:.3f}"
    base_values = [accuracy_at(r, step) for r in base or []]
    if base_values and None not in base_values:
        mb, seb = mean_se(base_values)
        sd = math.sqrt(se**2 + seb**2)  # NaN with one seed: no bracket
        if sd > 0:
            text += f" [{(m - mb) / sd:+.1f}]"
        elif sd == 0:  # every seed of both at the same value
            text += " [0]" if m == mb else f" [{'+' if m > mb else '-'}inf]"
    return text


def report(
    results: list[dict], tasks: list[str], variants: dict[str, list[str]], steps: dict[str, int]
) -> list[str]:
    lines = []
    for task in tasks:
        thr = threshold(task)
        e = TASKS[task]
        what = "episode success" if task == "tool" else "accuracy"
        at = [s for s in REPORT_STEPS if s < steps[task]]
        cols = [f"step {s}" for s in at] + [f"end ({steps[task]})"]
        lines += [
            f"\n{task} ({e.describe}; start: plain greedy {e.plain_greedy:.3f}, hinted greedy "
            f"{e.hinted_greedy:.3f}) — held-out greedy {what}, mean ± SE over seeds "
            f"[difference to rl_only / sqrt(se² + se_rl²)]; steps to {what} ≥ {thr:.2f}:",
            f"| variant | {' | '.join(cols)} | steps to {thr:.2f} (seeds) | pass@4, end | "
            "train reward, last 10 | wall s |",
            "|---|" + "---|" * (len(cols) + 4),
        ]
        base = [r for r in results if r["task"] == task and r["variant"] == "rl_only"]
        for variant in variants[task]:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            ref = None if variant == "rl_only" else base
            accs = [cell(rs, ref, s) for s in (*at, None)]
            reached = [next((s for s, v in r["val/accuracy"] if v >= thr), None) for r in rs]
            hit = [s for s in reached if s is not None]
            to_thr = (
                f"{sum(hit) / len(hit):.0f} ({len(hit)}/{len(rs)})" if hit else f"— (0/{len(rs)})"
            )
            p4 = mean_se([r["val/pass@4"][-1][1] for r in rs])
            tail = [[v for _, v in r["rollout/reward_mean"][-10:]] for r in rs]
            reward = mean_se([sum(t) / len(t) for t in tail])
            wall = sum(r["wall"] for r in rs) / len(rs)
            lines.append(
                f"| {variant} | {' | '.join(accs)} | {to_thr} | {p4[0]:.3f} ± {p4[1]:.3f} | "
                f"{reward[0]:.3f} ± {reward[1]:.3f} | {wall:.0f} |"
            )
    return lines


def plot(results: list[dict], tasks: list[str], variants: dict[str, list[str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(tasks), figsize=(4.5 * len(tasks), 4.5), sharey=True, squeeze=False
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        for variant in variants[task]:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            steps = [s for s, _ in rs[0]["val/accuracy"]]
            curves = [[v for _, v in r["val/accuracy"]] for r in rs]
            stats = [mean_se([c[i] for c in curves]) for i in range(len(steps))]
            mean = [m for m, _ in stats]
            se = [0.0 if math.isnan(s) else s for _, s in stats]
            color = f"C{list(VARIANTS).index(variant)}"  # the same colour in every panel
            ax.plot(steps, mean, marker="o", ms=3, label=variant, color=color)
            ax.fill_between(
                steps,
                [m - s for m, s in zip(mean, se, strict=True)],
                [m + s for m, s in zip(mean, se, strict=True)],
                alpha=0.15,
                color=color,
            )
        ax.axhline(threshold(task), color="grey", lw=0.8, ls="--")
        ax.set_title(f"{task} (T = {TASKS[task].temperature})", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    what = "episode success" if tasks == ["tool"] else "accuracy"
    axes[0][0].set_ylabel(f"held-out greedy {what} (mean ± SE over seeds)")
    for ax in axes[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def key_values(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"1 seed, {QUICK_STEPS} steps")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="steps of every task (else STEPS)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--tasks", nargs="+", default=list(SUITE), choices=list(TASKS))
    ap.add_argument(
        "--variants", nargs="+", default=None, choices=list(VARIANTS),
        help="for every task (else each task's own: DEFAULT_VARIANTS, TOOL_VARIANTS for tool)",
    )  # fmt: skip
    ap.add_argument("--weights", nargs="+", default=[], metavar="HEAD=W", help="e.g. sdpo=1.0")
    ap.add_argument(
        "--head-args", nargs="+", default=[], metavar="HEAD.ARG=V", help="e.g. opd.gap_clip=1.0"
    )
    ap.add_argument("--sdpo-clip-mode", choices=["element", "token", "scale"], default=None)
    ap.add_argument("--candidates", type=int, default=3, help="hints per sample for top-k OPD")
    ap.add_argument("--png", default=str(ROOT / "docs" / "ablation.png"))
    ap.add_argument("--json", default=None, help="also write every run's curves here")
    ap.add_argument(
        "--fit-arg", action="append", default=[], metavar="--KEY=VALUE",
        help="one more override of every run's fit (repeatable), e.g. "
        "--fit-arg=--rollout.max_staleness=2",
    )  # fmt: skip
    args = ap.parse_args()
    overrides = key_values(args.weights, "--weights")
    for head in overrides:
        if head not in WEIGHTS:
            raise SystemExit(f"--weights: unknown head {head!r}; heads: {sorted(WEIGHTS)}")
    arg_overrides = []
    for path, value in key_values(args.head_args, "--head-args").items():
        head, _, arg = path.partition(".")
        if head not in HEAD_ARGS or not arg:
            raise SystemExit(f"--head-args: expected HEAD.ARG with HEAD in {sorted(HEAD_ARGS)}")
        arg_overrides.append((head, arg, yaml.safe_load(value)))
    cfg = {}  # task → its weights, head arguments, candidates
    for task in args.tasks:
        weights = {**WEIGHTS, **TASK_WEIGHTS.get(task, {})}
        weights.update({head: float(w) for head, w in overrides.items()})
        head_args = {h: dict(a) for h, a in HEAD_ARGS.items()}
        for head, a in TASK_HEAD_ARGS.get(task, {}).items():
            head_args[head].update(a)
        if args.sdpo_clip_mode is not None:
            head_args["sdpo"]["clip_mode"] = args.sdpo_clip_mode
        for head, arg, value in arg_overrides:
            head_args[head][arg] = value
        cfg[task] = {
            "weights": weights,
            "head_args": head_args,
            "candidates": args.candidates,
            "fit_args": list(args.fit_arg),
        }
    variants = {t: args.variants or TASKS[t].variants for t in args.tasks}
    for task in args.tasks:
        if not TASKS[task].hints_candidates and any(
            NEEDS_CANDIDATES & set(VARIANTS[v]) for v in variants[task]
        ):
            raise SystemExit(f"{task}: its hint provider has no candidate hints for top-k OPD")
    seeds = args.seeds[:1] if args.quick else args.seeds
    steps = {t: QUICK_STEPS if args.quick else (args.steps or STEPS[t]) for t in args.tasks}
    jobs = [(t, v, s) for t in args.tasks for v in variants[t] for s in seeds]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run, t, v, s, steps[t], cfg[t], f"{tmp}/{t}_{v}_{s}") for t, v, s in jobs
        ]
        results, failed = [], []
        for job, future in zip(jobs, futures, strict=True):
            try:
                results.append(future.result())
            except RuntimeError as err:  # one broken run (a head not there yet) keeps the rest
                failed.append(job)
                print(err, file=sys.stderr)
    total = time.perf_counter() - start
    by_config: dict[str, list[str]] = {}
    for t in args.tasks:
        by_config.setdefault(TASKS[t].config, []).append(f"{t}: {steps[t]} steps")
    plan = "; ".join(f"configs/{c} ({', '.join(p)})" for c, p in by_config.items())
    print(
        f"{plan}; evaluation every {VAL_EVERY}, seeds {seeds}, {args.jobs} runs at a time, "
        f"{len(jobs)} runs, {total / 60:.1f} min"
    )
    by_heads: dict[str, list[str]] = {}  # the heads' settings → the tasks that have them
    for t in args.tasks:
        used = sorted({h for v in variants[t] for h in VARIANTS[v]})
        w, a = cfg[t]["weights"], cfg[t]["head_args"]
        text = "; ".join(f"{h} {json.dumps({'weight': w[h], **a[h]})}" for h in used)
        by_heads.setdefault(text, []).append(t)
    for text, ts in by_heads.items():
        print(f"heads ({', '.join(ts)}): {text}")
    print("\n".join(report(results, args.tasks, variants, steps)))
    plot(results, args.tasks, variants, Path(args.png))
    print(f"\nwrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg, "runs": results}))
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (task, variant, seed): {failed}")


if __name__ == "__main__":
    main()

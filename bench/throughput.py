"""Throughput: generation overlapped with training (max_staleness k) and TRL side by side.

    python bench/throughput.py [--rounds 3] [--steps 20] [--models tiny 20M] [--accuracy]

The same batch everywhere: 8 prompts × G = 4 of the arithmetic task, Dr. GRPO only, one update
per rollout batch, fp32, fused AdamW (lr 1e-4, no weight decay: TRL's defaults), gradient
clipping at 1; 1 thread for the trainer and (k ≥ 1) 1 for the engine's own process. Rows:
- `k=0`: this library, strictly on-policy (generate, then update, then push);
- `k=1`, `k=2`: this library, the engine generating batch m + k in its own process while the
  trainer updates on batch m (`RolloutCallback(max_staleness=k)`);
- `TRL`: `trl.GRPOTrainer(loss_type="dr_grpo")` with HF `generate`, when TRL is installed
  (`pip install -e .[bench]`; never a test dependency).
Models: the shipped tiny policy (≈ 3 new tokens per answer) and a 20M random Llama (vocab
8192, hidden 512, 6 layers) that writes 32 new tokens. Each configuration runs `--steps`
steps in its own process; the step time is the median after 3 warm-up steps; rounds alternate
the configurations and the table shows medians over rounds. `fixed ms` is the push (k = 0:
vLLM's in-place reload; k ≥ 1: the copy into the shared ring, the engine's process reloads on
its own core) plus the step's one metrics write. `--accuracy` also trains the main job for 200
steps with k = 0 and k = 1 on 3 seeds and compares held-out greedy accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BATCH = 8 * 4  # prompts x G, every run
MODEL_20M = dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=768)


def model_dir(name: str, tmp: str) -> str:
    """The tiny policy, or a 20M random Llama saved with the tiny policy's tokenizer files."""
    from composer_lightning.models.tiny import tiny_policy_path

    if name == "tiny":
        return tiny_policy_path()
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


# ------------------------------------------------------------------ one measured process
def ours(path: str, k: int, steps: int, max_tokens: int) -> dict:
    import lightning as L
    import torch

    import composer_lightning.module as module_file
    from composer_lightning.callbacks.rollout import RolloutCallback
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import SamplingConfig, VLLMEngine
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.module import ComposerModule

    torch.set_num_threads(1)
    starts: list[float] = []
    tokens: list[float] = []
    push: list[float] = []
    logging: list[float] = []
    log_step = module_file.log_step

    def timed_log_step(*args, **kw):  # the step's one metrics write
        t0 = time.perf_counter()
        log_step(*args, **kw)
        logging.append(time.perf_counter() - t0)

    module_file.log_step = timed_log_step

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            starts.append(time.perf_counter())  # step time: start to start, everything in

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            tokens.append(float(batch["rollout"].response_mask.sum()))
            push.append(float(trainer.callback_metrics.get("rollout/push_time", 0.0)))

    callback = RolloutCallback(
        VLLMEngine(seed=0),
        group_size=4,
        max_staleness=k,
        samples_every_n_steps=0,
        sampling=SamplingConfig(max_tokens=max_tokens, seed=0),
    )
    module = ComposerModule(
        path,
        [DrGRPOHead()],
        # TRL's optimizer: transformers' default `adamw_torch_fused`, weight decay 0
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.0, fused=True),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback, Clock()],
    )
    trainer.fit(module, RolloutDataModule(prompts_per_step=8, val_prompts=0))
    times = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    step = statistics.median(times[3:])
    return {
        "step_s": step,
        "tok_s": statistics.median(tokens[3:]) / step,
        "push_ms": 1e3 * statistics.median(push[4:]),  # push_time is the previous step's
        "log_ms": 1e3 * statistics.median(logging[3:]),
    }


def trl(path: str, steps: int, max_tokens: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from composer_lightning.tasks import Arithmetic, VerifierScore

    torch.set_num_threads(1)
    task = Arithmetic()
    problems = task.samples(8 * (steps + 2), seed=0)
    data = Dataset.from_list([{"prompt": p["messages"], "answer": p["answer"]} for p in problems])
    verifier = VerifierScore(task)

    def reward(prompts, completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return verifier.score([{"answer": a} for a in answer], texts)

    starts: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            starts.append(time.perf_counter())  # start to start, everything in

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(BATCH * float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            loss_type="dr_grpo",
            num_generations=4,
            per_device_train_batch_size=32,
            gradient_accumulation_steps=1,
            max_completion_length=max_tokens,
            learning_rate=1e-4,
            beta=0.0,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(path),
            callbacks=[Clock()],
        )
        trainer.train()
    times = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    step = statistics.median(times[3:])
    nan = float("nan")
    tok_s = statistics.median(lengths[3:]) / step if len(lengths) > 3 else nan
    return {"step_s": step, "tok_s": tok_s, "push_ms": nan, "log_ms": nan}


# ------------------------------------------------------------------ the driver
def measure(kind: str, model: str, args: argparse.Namespace, tmp: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        model,
        "--steps",
        str(args.steps),
        "--tmp",
        tmp,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind}/{model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
                accs.append(acc.Scalars("val/greedy_accuracy")[-1].value)
        m = statistics.mean(accs)
        se = statistics.stdev(accs) / len(accs) ** 0.5 if len(accs) > 1 else float("nan")
        lines.append(f"| {k} | {m:.3f} ± {se:.3f} | {', '.join(f'{a:.3f}' for a in accs)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", nargs="+", default=["tiny", "20M"], choices=["tiny", "20M"])
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, model = args.worker
        path = model_dir(model, args.tmp)
        max_tokens = 8 if model == "tiny" else 32
        out = (
            trl(path, args.steps, max_tokens)
            if kind == "trl"
            else ours(path, int(kind[2:]), args.steps, max_tokens)
        )
        print(json.dumps(out))
        sys.stdout.flush()
        os._exit(0)
    import importlib.util

    kinds = ["k=0", "k=1", "k=2"] + (["trl"] if importlib.util.find_spec("trl") else [])
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir(model, tmp)
            for r in range(args.rounds):
                order = kinds if r % 2 == 0 else kinds[::-1]  # alternate the order of the runs
                for kind in order:
                    results.setdefault((model, kind), []).append(measure(kind, model, args, tmp))
    print(
        f"8 prompts x G=4, Dr. GRPO, 1 update per batch, fp32, {args.steps} steps per run, "
        f"medians over {args.rounds} alternated rounds"
    )
    print(
        "| model | run | s/step | steps/s | vs k=0 | vs TRL | generated tok/s "
        "| push ms | logging ms | fixed ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        med = {
            kind: statistics.median(x["step_s"] for x in results[(model, kind)]) for kind in kinds
        }
        for kind in kinds:
            runs = results[(model, kind)]
            tok = statistics.median(x["tok_s"] for x in runs)
            push = statistics.median(x["push_ms"] for x in runs)
            logging = statistics.median(x["log_ms"] for x in runs)
            vs_trl = f"{med['trl'] / med[kind]:.2f}x" if "trl" in med else "n/a"
            print(
                f"| {model} | {kind} | {med[kind]:.3f} | {1 / med[kind]:.2f} | "
                f"{med['k=0'] / med[kind]:.2f}x | {vs_trl} | {tok:.0f} | "
                f"{push:.1f} | {logging:.2f} | {push + logging:.1f} |".replace("nan", "—")
            )
    if "trl" not in kinds:
        print("TRL is not installed: pip install -e .[bench] for the TRL rows")
    if args.accuracy:
        print("\n".join(accuracy(args.seeds)))


if __name__ == "__main__":
    main()

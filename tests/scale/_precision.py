"""One AdamW step at lr 1e-6 under each precision setting; write what the weights did as JSON.

    python tests/scale/_precision.py OUT.json

For each of fp32 (32-true), bf16-mixed on one device (autocast, fp32 weights), bf16-mixed
under ModelParallelStrategy (FSDP2 MixedPrecisionPolicy: bf16 params in compute, fp32 master
weights and fp32 gradient reduction) and bf16-true (bf16 weights), records:
- `update_err`: |Δw − Δw_expected| / |Δw_expected|, where Δw_expected is AdamW's first step
  computed in float64 from the gradient the run itself produced (did the update land?);
- `grad_err`: |g − g_fp32| / |g_fp32| against the fp32 run's gradient (bf16 compute noise);
- `absorbed`: the module's `train/absorbed_update_frac`, and whether it warned.
Runs in its own process: ModelParallelStrategy initialises torch.distributed.
"""

import json
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.models.factory import TinyLlama
from composer_lightning.models.weights import iter_hf_weights
from composer_lightning.training.module import ComposerModule

LR, EPS = 1e-6, 1e-8


class Capture(L.Callback):
    """The weights and gradients right before the optimizer step, as full fp64 tensors."""

    def on_before_optimizer_step(self, trainer, module, optimizer):
        full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()  # noqa: E731
        self.params = {n: full(p) for n, p in module.policy.named_parameters()}
        self.grads = {n: full(p.grad) for n, p in module.policy.named_parameters()}
        self.dtype = str(next(module.policy.parameters()).dtype)


def run(precision: str, strategy) -> dict:
    policy = TinyLlama(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, seed=0)
    batch = synthetic_batch(
        torch.Generator().manual_seed(0),
        prompts=4,
        group_size=4,
        vocab_size=64,
        reward_prob=1.0,
        hint_prob=0.5,
    )
    module = ComposerModule(
        policy,
        [DrGRPOHead(), OPDHead()],
        max_logprob_gap=None,
        max_grad_norm=None,
        optimizer=lambda p: torch.optim.AdamW(p, lr=LR, eps=EPS, weight_decay=0.0),
    )
    cap = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cap],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    after = {n: t.detach().double() for n, t in iter_hf_weights(module.policy)}
    num = den = 0.0
    for n, g in cap.grads.items():
        expected = -LR * g / (g.abs() + EPS)  # AdamW's bias-corrected first step
        num += float(((after[n] - cap.params[n]) - expected).square().sum())
        den += float(expected.square().sum())
    return {
        "update_err": (num / den) ** 0.5,
        "param_dtype": cap.dtype,
        "grads": cap.grads,
        "absorbed": float(trainer.callback_metrics.get("train/absorbed_update_frac", -1.0)),
        "warned": any("did not change" in str(w.message) for w in caught),
    }


def main() -> None:
    results = {
        "fp32": run("32-true", "auto"),
        "bf16_mixed": run("bf16-mixed", "auto"),
        "fsdp2_bf16_mixed": run("bf16-mixed", ModelParallelStrategy(1, 1)),
        "bf16_true": run("bf16-true", "auto"),
    }
    ref = results["fp32"]["grads"]
    for r in results.values():
        g = r.pop("grads")
        num = sum(float((g[n] - ref[n]).square().sum()) for n in ref)
        r["grad_err"] = (num / sum(float(v.square().sum()) for v in ref.values())) ** 0.5
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    import os

    os._exit(0)  # skip gloo's interpreter teardown

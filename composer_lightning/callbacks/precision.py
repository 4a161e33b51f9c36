"""`AbsorbedUpdates`: report 16-bit weights that swallow the optimizer's updates.

With `precision="bf16-true"` the weights themselves are bf16, with no fp32 master copy: an
update below half an ulp of a weight leaves it unchanged (at lr 1e-6 AdamW, about 98 % of the
weights of a small model stay bit-identical). On a run's first rollout batch this callback
measures, among the weights with a non-zero gradient, the fraction that did not change, logs it
as `train/absorbed_update_frac` and warns above 10 %. `ComposerModule` adds it itself
(`configure_callbacks`), so such a run is never silent; fp32 weights are not checked.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from torch import Tensor

_HALF = (torch.bfloat16, torch.float16)


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class AbsorbedUpdates(L.Callback):
    """Measure, once, how many 16-bit weights a rollout batch's updates failed to move."""

    def __init__(self, threshold: float = 0.1):
        self.threshold = threshold
        self._before: list[Tensor] | None = None
        self._done = False

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if self._done or self._before is not None:
            return
        params = self._params(pl_module)
        if not params:
            self._done = True
            return
        self._before = [_local(p).detach().clone() for p in params]

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._done or self._before is None:
            return
        self._done = True
        moved = considered = 0
        for p, before in zip(self._params(pl_module), self._before, strict=True):
            if p.grad is None:
                continue
            live = _local(p.grad) != 0
            considered += int(live.sum())
            moved += int((live & (_local(p).detach() != before)).sum())
        self._before = None
        frac = 1.0 - moved / max(considered, 1)
        pl_module.log("train/absorbed_update_frac", frac, on_step=True, batch_size=1)
        if frac > self.threshold:
            dtype = next(iter(self._params(pl_module))).dtype
            warnings.warn(
                f"{frac:.1%} of the policy's {dtype} weights with a non-zero gradient did "
                "not change in the first rollout batch's update: updates below half an "
                "ulp are absorbed by 16-bit weights. Use precision='bf16-mixed' (fp32 "
                "master weights, bf16 compute)",
                stacklevel=2,
            )

    @staticmethod
    def _params(pl_module: L.LightningModule) -> list[Tensor]:
        policy = getattr(pl_module, "policy", pl_module)
        return [p for p in policy.parameters() if p.requires_grad and p.dtype in _HALF]

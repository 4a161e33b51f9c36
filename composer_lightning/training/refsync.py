"""A reference that follows the policy: every N optimizer steps `ref ← α·θ + (1 − α)·ref`
(TR-DPO, Gorbatovski et al. 2024, https://arxiv.org/abs/2404.09656; TRL's `sync_ref_model`,
`ref_model_mixup_alpha`, `ref_model_sync_steps`, `SyncRefModelCallback`).

The synced reference is state: it is saved in checkpoints beside the policy (and sharded with
it under FSDP2), so a resumed run's KL is taken against the same reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def mix_parameters_(target: nn.Module, source: nn.Module, alpha: float) -> None:
    """`target ← (1 − alpha)·target + alpha·source`, parameter by parameter, in place (TRL's
    `SyncRefModelCallback._sync_target_model`). The two modules' parameters must pair up by
    name and shape (`check_pairs`). Under FSDP2 both are sharded alike: each rank mixes its own
    shards, no collective."""
    with torch.no_grad():
        sources = dict(source.named_parameters())
        for name, t in target.named_parameters():
            t.mul_(1.0 - alpha).add_(sources[name].to(t.dtype), alpha=alpha)


class ReferenceSync:
    """When to mix the policy into the reference, checked against the models once.

    Args:
        every_n_steps: sync after every N-th optimizer step (TRL's `ref_model_sync_steps`);
            0: never.
        alpha: the policy's share of the mix, in (0, 1] (TRL's `ref_model_mixup_alpha`).
    """

    def __init__(self, every_n_steps: int = 0, alpha: float = 0.6):
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 0
        ):
            raise ValueError(f"ref_model_sync_steps must be an integer >= 0, got {every_n_steps!r}")
        if not (math.isfinite(alpha) and 0 < alpha <= 1):
            raise ValueError(f"ref_model_mixup_alpha must be in (0, 1], got {alpha}")
        self.every_n_steps, self.alpha = every_n_steps, float(alpha)

    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0

    def check(self, policy: nn.Module, reference: nn.Module | None, lora: bool) -> None:
        """Refuse, in one line, a sync with nothing to sync or nothing to sync with."""
        if not self.enabled:
            return
        if lora:
            raise ValueError(
                f"ref_model_sync_steps={self.every_n_steps} mixes the policy into the reference, "
                "but a LoRA policy's reference is the policy with its adapters off (no weights "
                "of its own): set ref_model_sync_steps=0 or train without model.peft"
            )
        if reference is None:
            raise ValueError(
                f"ref_model_sync_steps={self.every_n_steps} needs a reference model, and no head "
                "with a non-zero weight reads reference log-probs (e.g. a KLHead): add one or "
                "set ref_model_sync_steps=0"
            )
        ours = {n: p.shape for n, p in policy.named_parameters()}
        theirs = {n: p.shape for n, p in reference.named_parameters()}
        if ours != theirs:
            odd = sorted(set(ours.items()) ^ set(theirs.items()))[:1]
            raise ValueError(
                "ref_model_sync_steps mixes the policy into the reference parameter by "
                f"parameter, and model.reference's parameters differ from the policy's (first: "
                f"{odd[0][0]} {tuple(odd[0][1])}): sync a reference of the policy's architecture"
            )

    def after_step(self, step: int, policy: nn.Module, reference: nn.Module | None) -> bool:
        """Mix after optimizer step `step` (counted from 1) when it is a multiple of N, as TRL's
        `on_step_end`; returns whether it did."""
        if not self.enabled or step % self.every_n_steps or reference is None:
            return False
        mix_parameters_(reference, policy, self.alpha)
        return True

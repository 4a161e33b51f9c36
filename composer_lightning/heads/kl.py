"""KL to a frozen reference, in the advantage (classic KL-in-reward, k1) or in the loss (k2/k3).

Estimators (Schulman, "Approximating KL Divergence", 2020) with `ρ = π_ref/π_θ` on sampled
tokens: `k1 = −log ρ`, `k2 = ½(log ρ)²`, `k3 = ρ − 1 − log ρ`. k1 is refused in the loss: its
expected gradient is zero.
"""

from __future__ import annotations

from typing import Literal

from composer_lightning.functional import kl_penalty
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext

_PLACEMENTS = ("advantage", "loss")


class KLHead(Head):
    """KL penalty to the reference model.

    Args:
        kl_coef: the KL coefficient (the head's weight). With 0 no reference model is built.
        estimator: `k1` (advantage only), `k2` or `k3`.
        placement: `advantage` (`−kl_coef · k_t` of the rollout policy: old vs reference
            log-probs, the same in every update of a rollout batch) or `loss`
            (`kl_coef · aggregate(k)` of the current policy, with grad).
        name, schedule: as `Head`'s.
    """

    default_name = "kl"
    requires = frozenset({"ref_logprobs"})

    def __init__(
        self,
        kl_coef: float = 0.001,
        estimator: Literal["k1", "k2", "k3"] = "k1",
        placement: Literal["advantage", "loss"] = "advantage",
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=kl_coef, schedule=schedule)
        if placement not in _PLACEMENTS:
            raise ValueError(
                f"{self.name}: placement must be one of {_PLACEMENTS}, got {placement!r}"
            )
        if estimator not in ("k1", "k2", "k3"):
            raise ValueError(
                f"{self.name}: estimator must be 'k1', 'k2' or 'k3', got {estimator!r}"
            )
        if placement == "loss" and estimator == "k1":
            raise ValueError(
                f"{self.name}: estimator 'k1' cannot be used in the loss (its expected "
                "gradient is zero); use 'k2' or 'k3', or placement='advantage'"
            )
        self.estimator = estimator
        self.placement = placement
        self.per_token_advantages = placement == "advantage"  # −kl_coef · k_t per token

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        mask = batch.response_mask
        n = mask.sum().clamp(min=1)
        if self.placement == "advantage":  # KL-in-reward: of the rollout policy, fixed per batch
            kl = kl_penalty(ctx.old_logprobs, ctx.ref_logprobs, self.estimator, response_mask=mask)
            return HeadOutput(
                advantages=-kl.detach(),
                active_mask=mask,
                metrics={f"{self.estimator}_mean": kl.detach().sum() / n},
            )
        kl = kl_penalty(
            ctx.logprobs, ctx.ref_logprobs, self.estimator, response_mask=mask
        )  # [B, T]
        return HeadOutput(
            loss=ctx.aggregate(kl, mask), metrics={f"{self.estimator}_mean": kl.detach().sum() / n}
        )

"""The objective of one minibatch: heads in, `(loss, metrics)` out.

`A = Σ w_i · advantages_i` over the advantage heads (optionally variance-matched) goes through
ONE clipped surrogate (`mixing="advantage"`), or each weighted term through its own surrogate,
summed (`mixing="loss"`, OpenClaw's "scheme A", for ablations); then `+ Σ w_j · loss_j` over
the loss heads and `− entropy_coef · aggregate(H)`. The loop around it (forwards, updates,
logging) lives in `ComposerModule`; this is the seam tests and other trainers call.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from composer_lightning.batch import RolloutBatch
from composer_lightning.functional import (
    masked_aggregate,
    policy_loss,
    truncated_importance_weights,
)
from composer_lightning.functional.policy import AGGREGATION_MODES
from composer_lightning.heads.base import TEACHER_SIGNALS, Head, HeadOutput
from composer_lightning.mixer import AdvantageTerm, masked_stats, variance_scales
from composer_lightning.step import StepContext

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]
Mixing = Literal["advantage", "loss"]


class Objective:
    """The composed loss of one minibatch.

    Args:
        heads: the loss heads (unique names).
        clip_low: PPO ε_low in (0, 1). clip_high: PPO ε_high > 0.
        dual_clip: dual-clip c > 1 for A < 0, or None.
        aggregation: how per-token losses are reduced (see `functional.masked_aggregate`).
        entropy_coef: entropy bonus coefficient (≥ 0).
        mixing: `advantage` (one surrogate on the mixed advantage) or `loss` (one per term).
        variance_matching: name of a reference advantage head, or None.
        importance_cap: for a stale batch (`ctx.behavior_logprobs` set), the surrogate's
            per-token loss is weighted by `min(exp(old − behaviour), importance_cap)`
            (truncated importance sampling, verl's `rollout_is_threshold`); None: no weights.
            Loss heads (SDPO, DPO) are not reweighted.
    """

    def __init__(
        self,
        heads: list[Head],
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        aggregation: Aggregation = "token_sum_norm",
        entropy_coef: float = 0.0,
        mixing: Mixing = "advantage",
        variance_matching: str | None = None,
        importance_cap: float | None = 2.0,
    ):
        self.heads = _check_heads(heads)
        if not 0 < clip_low < 1:
            raise ValueError(f"clip_low must be in (0, 1), got {clip_low}")
        if not clip_high > 0:
            raise ValueError(f"clip_high must be > 0, got {clip_high}")
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
        if aggregation not in AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")
        if mixing not in ("advantage", "loss"):
            raise ValueError(f"mixing must be one of ('advantage', 'loss'), got {mixing!r}")
        if not (entropy_coef >= 0 and math.isfinite(entropy_coef)):
            raise ValueError(f"entropy_coef must be finite and >= 0, got {entropy_coef}")
        names = [h.name for h in self.heads]
        if variance_matching is not None and variance_matching not in names:
            raise ValueError(
                f"variance_matching names head {variance_matching!r}, which is not "
                f"among the heads {names}"
            )
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.aggregation, self.entropy_coef = aggregation, entropy_coef
        if importance_cap is not None and not importance_cap >= 1:
            raise ValueError(f"importance_cap must be >= 1 or None, got {importance_cap}")
        self.mixing, self.variance_matching = mixing, variance_matching
        self.importance_cap = importance_cap

    def weights(self, step: int) -> dict[str, float]:
        """Every head's effective weight at optimizer step `step`."""
        return {h.name: h.effective_weight(step) for h in self.heads}

    def requirements(self, weights: dict[str, float]) -> set[str]:
        """What the heads with a non-zero weight read from the step context."""
        needs = set().union(*(h.requires for h in self.heads if weights[h.name] > 0))
        return needs | ({"entropy"} if self.entropy_coef > 0 else set())

    def reads_teacher(self) -> bool:
        """Whether a head with a non-zero configured weight reads a hinted teacher (OPD, SDPO,
        top-k OPD); if none does, the rollout side asks no hint provider for hints."""
        return any(h.weight > 0 and h.requires & TEACHER_SIGNALS for h in self.heads)

    def topk(self) -> int:
        """The largest top-k any head with a non-zero configured weight reads (0: none)."""
        return max((h.topk for h in self.heads if h.weight > 0), default=0)

    def requirements_over(self, step: int, updates: int) -> set[str]:
        """What the heads read over the `updates` optimizer steps starting at `step`."""
        return set().union(*(self.requirements(self.weights(step + k)) for k in range(updates)))

    def head_outputs(
        self, batch: RolloutBatch, ctx: StepContext, weights: dict[str, float]
    ) -> dict[str, HeadOutput]:
        """Each non-zero-weight head's output (a zero-weight head is not computed at all, so it
        cannot touch any gradient)."""
        return {h.name: h.compute(batch, ctx) for h in self.heads if weights[h.name] != 0.0}

    def advantage_terms(
        self, batch: RolloutBatch, outputs: dict[str, HeadOutput], weights: dict[str, float]
    ) -> list[AdvantageTerm]:
        """One term per advantage head; its `weight` is the effective one (variance-matched)."""
        terms = [
            AdvantageTerm(
                name,
                weights[name],
                out.advantages.detach(),
                (out.active_mask if out.active_mask is not None else batch.response_mask).bool(),
            )
            for name, out in outputs.items()
            if out.advantages is not None
        ]
        scales = variance_scales(terms, self.variance_matching)
        return [t._replace(weight=t.weight * scales[t.name]) for t in terms]

    def __call__(
        self, batch: RolloutBatch, ctx: StepContext, weights: dict[str, float]
    ) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The minibatch loss and its metrics (`<head>/<metric>`, `ppo/…`, `train/loss`)."""
        outputs = self.head_outputs(batch, ctx, weights)
        metrics: dict[str, Tensor | float] = {f"{name}/weight": w for name, w in weights.items()}
        total = ctx.logprobs.sum() * 0.0
        for name, out in outputs.items():
            metrics.update({f"{name}/{k}": v for k, v in out.metrics.items()})
            if out.advantages is not None:
                active = out.active_mask if out.active_mask is not None else batch.response_mask
                metrics[f"{name}/adv_mean"], metrics[f"{name}/adv_std"] = masked_stats(
                    out.advantages, active.bool()
                )
            else:
                metrics[f"{name}/loss"] = out.loss.detach()
                total = total + weights[name] * out.loss
        terms = self.advantage_terms(batch, outputs, weights)
        if terms:
            metrics.update({f"{t.name}/weight": t.weight for t in terms})
            pg, pg_metrics = self.surrogate(ctx, batch, terms)
            metrics.update({f"ppo/{k}": v for k, v in pg_metrics.items()})
            metrics["ppo/loss"] = pg.detach()
            total = total + pg
        if ctx.has("entropy"):
            metrics["entropy"] = masked_aggregate(
                ctx.entropy.detach(), batch.response_mask, "token_mean"
            )
            if self.entropy_coef > 0:
                total = total - self.entropy_coef * ctx.aggregate(ctx.entropy, batch.response_mask)
        metrics["train/loss"] = total.detach()
        return total, metrics

    def surrogate(
        self, ctx: StepContext, batch: RolloutBatch, terms: list[AdvantageTerm]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate of the weighted advantage terms, per `mixing`."""
        weights, is_metrics = self.importance_weights(ctx, batch)
        kw = dict(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            aggregation=self.aggregation,
            norm_length=ctx.norm_length,
            weights=weights,
        )
        scaled = [t.weight * t.advantages for t in terms]
        mixed = torch.stack(scaled).sum(0)  # [B, T]
        if self.mixing == "advantage":
            loss, metrics = policy_loss(
                ctx.logprobs, ctx.old_logprobs, mixed, batch.response_mask, **kw
            )
        else:
            loss = sum(
                policy_loss(ctx.logprobs, ctx.old_logprobs, a, batch.response_mask, **kw)[0]
                for a in scaled
            )
            with torch.no_grad():
                _, metrics = policy_loss(
                    ctx.logprobs, ctx.old_logprobs, mixed, batch.response_mask, **kw
                )
        return loss, metrics | {f"is_{k}": v for k, v in is_metrics.items()}

    def importance_weights(
        self, ctx: StepContext, batch: RolloutBatch
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """The truncated importance weights of a stale batch (None on policy)."""
        if ctx.behavior_logprobs is None or self.importance_cap is None:
            return None, {}
        return truncated_importance_weights(
            ctx.old_logprobs, ctx.behavior_logprobs, batch.response_mask, self.importance_cap
        )


def _check_heads(heads: list[Head]) -> list[Head]:
    if not heads:
        raise ValueError("the objective needs at least one head")
    for h in heads:
        if not isinstance(h, Head):
            raise TypeError(f"heads must be Head instances, got {type(h).__name__}: {h!r}")
    names = [h.name for h in heads]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate head names {dupes}: give each head a unique `name`")
    return list(heads)

"""The surrogate's options, checked, and its token masks (high entropy, off policy) of a step.

The objective (`objective.py`) passes them to `functional.policy_loss`; this says in one line
what cannot work together before a step runs: dual clip without a clip, GSPO's sequence ratio
beside a head whose advantages differ along a response.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from composer_lightning.functional import high_entropy_mask, off_policy_sequence_mask
from composer_lightning.functional.policy import LOSS_MODES, RATIO_LEVELS
from composer_lightning.heads.base import Head
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext
from composer_lightning.runtime.distributed import per_rank


def kept_share(kept: Tensor, mask: Tensor) -> Tensor:
    """The share of the response tokens `kept` keeps (1 with none)."""
    m = mask.bool()
    n = m.sum()
    return (kept.bool() & m).sum() / n if n else kept.new_ones(())


def check_surrogate(
    heads: list[Head],
    loss_mode: str,
    level: str,
    dual_clip: float | None,
    sapo_temperatures: tuple[float, float],
    top_entropy_quantile: float,
    off_policy_mask_threshold: float | None,
) -> None:
    """Refuse, in one line each, surrogate options out of range or at odds with each other or
    with the heads."""
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {loss_mode!r}")
    if level not in RATIO_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {RATIO_LEVELS}, got {level!r}")
    if dual_clip is not None and loss_mode != "clip":
        raise ValueError(
            f"dual_clip={dual_clip} bounds the clipped surrogate; loss_mode={loss_mode!r} has "
            "none: leave dual_clip unset or use loss_mode='clip'"
        )
    for name, tau in zip(("pos", "neg"), sapo_temperatures, strict=True):
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"sapo_temperature_{name} must be finite and > 0, got {tau}")
    if not 0 < top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    t = off_policy_mask_threshold
    if t is not None and not (math.isfinite(t) and t >= 0):
        raise ValueError(f"off_policy_mask_threshold must be finite and >= 0 or None, got {t}")
    spread = [h.name for h in heads if h.per_token_advantages and h.weight > 0]
    if level == "sequence" and spread:
        raise ValueError(
            f"importance_sampling_level='sequence' (GSPO) gives every token of a response one "
            f"ratio, spreading per-token advantages over it; head(s) {spread} give per-token "
            "advantages: use importance_sampling_level='sequence_token' (GSPO-token)"
        )


def entropy_tokens(ctx: StepContext, batch: RolloutBatch, quantile: float) -> Tensor:
    """`[B, T]` bool, the response tokens in the top `quantile` of entropy, the threshold taken
    over every rank's minibatch (a collective: every rank calls it in every step)."""
    mask = batch.response_mask.bool()
    ent = ctx.entropy.detach()
    pool = torch.cat([p.to(ent) for p in cast(list[Tensor], per_rank(ent[mask].cpu()))])
    return high_entropy_mask(ent, mask, quantile, pool).bool()


def off_policy_tokens(
    ctx: StepContext,
    batch: RolloutBatch,
    advantages: Tensor,  # [B, T] the mixed advantage
    threshold: float,
) -> Tensor:  # [B, T] 0/1
    """DeepSeek-V3.2's off-policy sequence mask against the engine's log-probs when the batch
    has them, else π_old's."""
    sampling = batch.engine_logprobs if batch.engine_logprobs is not None else ctx.old_logprobs
    return off_policy_sequence_mask(
        advantages, ctx.logprobs, sampling.to(ctx.logprobs), batch.response_mask, threshold
    )

"""Truncated importance weights: the correction for rollouts sampled by a stale policy.

With generation overlapped with training, rollout batch m is sampled by the weights of version
m − k (the behaviour policy μ) while the trainer is at version m (the proximal policy π_old,
whose log-probs the clipped ratio is taken against). The surrogate's per-token loss is
multiplied by `w = min(π_old / μ, cap)`, detached: the "decoupled" PPO objective (Hilton et al.
2022; AReaL, Fu et al. 2025) with truncated importance sampling (Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"), as verl's
`rollout_is_weights` (`exp(old_log_prob − rollout_log_probs)` clamped at the threshold) and
PRIME-RL do. The trust region stays centred on the trainer's current weights, and the
truncation bounds the variance a rare token sampled far from π_old could add.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_range, check_same_shape


def scored_log_ratio(
    numerator: Tensor,  # [B, T] log-probs
    denominator: Tensor,  # [B, T] log-probs
    mask: Tensor,  # [B, T] bool
) -> Tensor:  # [B, T]
    """`numerator − denominator` (detached) on the masked tokens; 0 elsewhere and where either
    log-prob is NaN. The one convention of every correction against the engine's log-probs: a
    token the engine could not score is no evidence, log-ratio 0, importance weight 1 (TRL's
    `nan_to_num(..., nan=0)`), never a NaN loss (`off_policy_sequence_mask` and
    `truncated_importance_weights` both read it).
    """
    log_ratio = torch.nan_to_num(numerator.detach() - denominator.detach(), nan=0.0)
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio))


def truncated_importance_weights(
    old_logprobs: Tensor,  # [B, T] proximal policy (the trainer's before the update)
    behavior_logprobs: Tensor,  # [B, T] the policy that sampled the tokens
    response_mask: Tensor,  # [B, T]
    cap: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`w = min(exp(old − behaviour), cap)` per token, detached; 1 outside the mask.

    The log-ratio is clamped to [-20, log(cap)] before the exp, so no weight overflows; a NaN
    log-prob (a token the engine could not score) weighs 1 (`scored_log_ratio`), wherever it
    is.

    Args:
        old_logprobs: log-probs of the sampled tokens under the proximal policy.
        behavior_logprobs: their log-probs under the behaviour (sampling) policy.
        response_mask: tokens that carry loss.
        cap: the truncation C ≥ 1.

    Returns:
        `(weights, metrics)`: `[B, T]` weights and, over the masked tokens, `weight_mean` (of
        the truncated weights), `weight_max` (of the raw ratio: how far off the batch is) and
        `clipped_frac` (the share of tokens whose raw ratio exceeds `cap`). With an empty mask
        every metric is 0 (`weight_mean` 1).
    """
    check_range("importance cap", cap, 1.0, low_closed=True)
    check_same_shape(
        ("old_logprobs", old_logprobs),
        ("behavior_logprobs", behavior_logprobs),
        ("response_mask", response_mask),
    )
    m = as_bool_mask(response_mask)
    with torch.no_grad():
        zero = torch.zeros_like(old_logprobs)
        log_ratio = scored_log_ratio(old_logprobs, behavior_logprobs, m)
        raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
        weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=math.log(cap)))
        n = m.sum()
        count = n.clamp(min=1).to(weights.dtype)
        metrics = {
            "weight_mean": torch.where(m, weights, zero).sum() / count
            if n
            else weights.new_ones(()),
            "weight_max": torch.where(m, raw, zero).amax() if n else zero.new_zeros(()),
            "clipped_frac": ((raw > cap) & m).sum() / count,
        }
    return torch.where(m, weights, torch.ones_like(weights)), metrics

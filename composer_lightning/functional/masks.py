"""Token masks that take tokens out of the policy-gradient surrogate: the high-entropy "forking"
tokens only, and the off-policy sequence mask.

Both return a detached 0/1 float `[B, T]` tensor the surrogate multiplies its per-token loss
by (`policy_loss(weights=...)`); the aggregation still counts every response token, as TRL's
`per_token_loss * entropy_mask` does before its masked reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_range, check_same_shape
from .importance import scored_log_ratio


def high_entropy_mask(
    entropy: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T]
    quantile: float,
    pool: Tensor | None = None,  # [N] the entropies the threshold is taken over
) -> Tensor:  # [B, T] float 0/1
    """Keep the response tokens whose entropy is in the top `quantile` share (Wang et al. 2025,
    "Beyond the 80/20 Rule", https://arxiv.org/abs/2506.01939; TRL `top_entropy_quantile`).

    The threshold is `torch.quantile(pool, 1 − quantile)` (linear interpolation), and a token
    is kept when its entropy is ≥ it, as TRL's `get_high_entropy_mask`.

    Args:
        entropy: per-token entropies (read detached).
        response_mask: tokens that carry loss.
        quantile: the share of tokens kept, in (0, 1]; 1 keeps every token.
        pool: the entropies of the response tokens the threshold is taken over (every rank's,
            gathered); None: this batch's own response tokens.

    Returns:
        `[B, T]` float 1 on kept response tokens, 0 elsewhere (all 0 with an empty pool).
    """
    check_range("top_entropy_quantile", quantile, 0.0, 1.0, high_closed=True)
    check_same_shape(("entropy", entropy), ("response_mask", response_mask))
    m = as_bool_mask(response_mask)
    ent = entropy.detach()
    if pool is None:
        pool = ent[m]
    if quantile == 1.0:
        return m.to(ent.dtype)
    if pool.numel() == 0:
        return torch.zeros_like(ent)
    threshold = torch.quantile(pool.to(ent.dtype), 1.0 - quantile)
    return ((ent >= threshold) & m).to(ent.dtype)


def off_policy_sequence_mask(
    advantages: Tensor,  # [B, T]
    logprobs: Tensor,  # [B, T] current policy
    sampling_logprobs: Tensor,  # [B, T] the policy that sampled the tokens
    response_mask: Tensor,  # [B, T]
    threshold: float,
) -> Tensor:  # [B, T] float 0/1
    """DeepSeek-V3.2's off-policy sequence mask (https://arxiv.org/abs/2512.02556; TRL
    `off_policy_mask_threshold`): drop a token with a negative advantage when its sequence's
    mean `log μ − log π` (μ the sampling policy, π the current one; detached) exceeds
    `threshold`: negative samples the policy has moved far from teach it nothing but noise.

    A NaN log-prob (a token the engine could not score) counts as no evidence (0), as TRL's
    (`importance.scored_log_ratio`, the importance weights' convention too).
    Advantages are per token: a token is kept when its own advantage is ≥ 0.

    Returns:
        `[B, T]` float 1 on kept response tokens, 0 elsewhere.
    """
    check_range("off_policy_mask_threshold", threshold, 0.0, low_closed=True)
    check_same_shape(
        ("advantages", advantages),
        ("logprobs", logprobs),
        ("sampling_logprobs", sampling_logprobs),
        ("response_mask", response_mask),
    )
    m = as_bool_mask(response_mask)
    with torch.no_grad():
        kl = scored_log_ratio(sampling_logprobs, logprobs, m)
        seq_kl = kl.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        keep = (advantages.detach() >= 0) | (seq_kl <= threshold)  # [B, T]
        return (keep & m).to(logprobs.dtype)

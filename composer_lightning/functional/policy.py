"""The clipped policy-gradient surrogate and the masked token aggregations it reduces with.

Reductions are computed with `torch.where` on the mask, never by multiplying with it, so
NaN/inf at masked positions reach neither the value nor the gradient, and masked tokens get a
gradient of exactly zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_ndim, check_range, check_same_shape

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")


def masked_aggregate(
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool or 0/1 float
    mode: str,
    norm_length: float | None = None,
) -> Tensor:  # []
    """Reduce per-token values over the masked tokens to a scalar.

    Modes (names follow verl's `agg_loss`):

    - `token_mean`: sum over masked tokens / number of masked tokens.
    - `seq_mean_token_mean`: each sequence's mean over its masked tokens, then the mean over
      the sequences that have at least one masked token.
    - `seq_mean_token_sum`: each sequence's sum over its masked tokens, then the mean over the
      sequences that have at least one masked token.
    - `token_sum_norm`: sum over masked tokens / (B * `norm_length`), the Dr. GRPO constant
      normaliser (Liu et al. 2025, https://arxiv.org/abs/2503.20783; TRL
      `loss_type="dr_grpo"`). Unlike verl's `seq-mean-token-sum-norm` it divides by B too.

    An empty mask gives a zero that is still attached to the graph, never NaN.

    Args:
        values: Per-token values.
        mask: Tokens to include.
        mode: One of `AGGREGATION_MODES`.
        norm_length: The constant length for `token_sum_norm` (usually the engine's
            `max_tokens`); ignored by the other modes.

    Returns:
        A scalar tensor.
    """
    check_choice("aggregation mode", mode, AGGREGATION_MODES)
    check_ndim("values", values, (2,))
    check_same_shape(("values", values), ("mask", mask))
    m = as_bool_mask(mask)
    v = torch.where(m, values, torch.zeros_like(values))  # [B, T]
    if mode == "token_mean":
        return v.sum() / m.sum().clamp(min=1)
    if mode == "token_sum_norm":
        if norm_length is None:
            raise ValueError("norm_length is required for aggregation mode 'token_sum_norm'")
        check_range("norm_length", norm_length, 0.0)
        return v.sum() / (values.shape[0] * float(norm_length))
    counts = m.sum(dim=-1)  # [B]
    per_seq = v.sum(dim=-1)  # [B]
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / counts.clamp(min=1)
    return per_seq.sum() / (counts > 0).sum().clamp(min=1)


def policy_loss(
    logprobs: Tensor,  # [B, T] current policy, with grad
    old_logprobs: Tensor,  # [B, T] behaviour policy
    advantages: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T] bool or 0/1 float
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: str = "token_sum_norm",
    norm_length: float | None = None,
    weights: Tensor | None = None,  # [B, T] detached per-token weights
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric ("clip-higher") bounds and optional dual clip.

    Per token, `r = exp(logprobs - old_logprobs)` and
    `l = max(-r*A, -clip(r, 1 - clip_low, 1 + clip_high)*A)` (Schulman et al. 2017, PPO; the
    asymmetric bounds of DAPO, Yu et al. 2025). With `dual_clip = c > 1`, tokens with A < 0 use
    `min(l, -c*A)` (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl
    `compute_policy_loss`). The per-token losses are reduced by `masked_aggregate`.

    The log-ratio is clamped to [-20, 20] before the exp, as verl's `compute_policy_loss`
    (`verl/trainer/ppo/core_algos.py`: `negative_approx_kl = torch.clamp(log_prob -
    old_log_prob, min=-20.0, max=20.0)`), so a stale or corrupt `old_logprobs` cannot overflow
    the ratio to inf; a clamped token passes no gradient through the ratio.

    With `weights` (e.g. `truncated_importance_weights` for a stale batch) each token's loss is
    multiplied by its weight before the aggregation, as verl's `rollout_is_weights`.

    Args:
        logprobs: Log-probs of the sampled tokens under the current policy.
        old_logprobs: Log-probs under the proximal policy (the one that generated them, on
            policy).
        advantages: Per-token advantages (detached by the caller).
        response_mask: Tokens that carry loss.
        clip_low: Lower clip epsilon, in (0, 1).
        clip_high: Upper clip epsilon, > 0.
        dual_clip: Dual-clip constant c > 1, or None for none.
        aggregation: A `masked_aggregate` mode.
        norm_length: Normaliser for `token_sum_norm`.
        weights: Per-token loss weights (detached), or None for all ones.

    Returns:
        `(loss, metrics)`: the scalar loss and detached scalar metrics over the masked tokens:
        `clipfrac` (the clipped branch strictly taken, as verl's `pg_clipfrac`), `ratio_mean`,
        `ratio_max`, and `dual_clipfrac` when `dual_clip` is set. With an empty mask every
        metric is 0.
    """
    check_range("clip_low", clip_low, 0.0, 1.0)
    check_range("clip_high", clip_high, 0.0)
    if dual_clip is not None:
        check_range("dual_clip", dual_clip, 1.0)
    check_same_shape(
        ("logprobs", logprobs),
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("response_mask", response_mask),
        *([("weights", weights)] if weights is not None else []),
    )
    m = as_bool_mask(response_mask)
    # Sanitise *before* exp: the where on the loss alone would still send 0 * NaN = NaN back
    # through exp into the masked positions' gradient.
    zero = torch.zeros_like(logprobs)
    lp = torch.where(m, logprobs, zero)
    old = torch.where(m, old_logprobs, zero)
    adv = torch.where(m, advantages, zero)

    ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))  # [B, T]
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    if dual_clip is not None:
        dual = -dual_clip * adv
        dual_taken = (adv < 0) & (dual < per_token)
        per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)
    if weights is not None:
        per_token = per_token * torch.where(m, weights.detach(), zero)
    per_token = torch.where(m, per_token, zero)
    loss = masked_aggregate(per_token, m, aggregation, norm_length)

    with torch.no_grad():
        n = m.sum().clamp(min=1).to(ratio.dtype)
        r = torch.where(m, ratio, zero)  # ratio > 0, so a 0 fill never wins the max
        metrics = {
            "clipfrac": ((clipped > unclipped) & m).sum() / n,
            "ratio_mean": r.sum() / n,
            "ratio_max": r.amax() if r.numel() else r.new_zeros(()),
        }
        if dual_clip is not None:
            metrics["dual_clipfrac"] = (dual_taken & m).sum() / n
    return loss, {k: v.detach() for k, v in metrics.items()}

"""The policy-gradient surrogate (PPO clip, CISPO, SAPO; token or sequence ratios) and the masked
token aggregations it reduces with.

Reductions are computed with `torch.where` on the mask, never by multiplying with it, so
NaN/inf at masked positions reach neither the value nor the gradient, and masked tokens get a
gradient of exactly zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_ndim, check_range, check_same_shape

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
LOSS_MODES = ("clip", "cispo", "sapo")
RATIO_LEVELS = ("token", "sequence", "sequence_token")


def masked_aggregate(
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool or 0/1 float
    mode: str,
    norm_length: float | None = None,
) -> Tensor:  # []
    """Reduce per-token values over the masked tokens to a scalar.

    Modes (names follow verl's `agg_loss`):

    - `token_mean`: sum over masked tokens / number of masked tokens.
    - `seq_mean_token_mean`: each sequence's mean over its masked tokens (0 for a sequence
      without any), then the mean over all B sequences, as TRL's `loss_type="grpo"` and
      `"sapo"` (`(loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)`, then `.mean()`): a
      sequence masked out whole (a truncated completion, a row of another head) dilutes the
      mean as it does `token_sum_norm`'s.
    - `seq_mean_token_sum`: each sequence's sum over its masked tokens, then the mean over all
      B sequences.
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
    return per_seq.sum() / max(values.shape[0], 1)


def importance_log_ratio(
    logprobs: Tensor,  # [B, T] current policy, with grad
    old_logprobs: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T] bool
    level: str = "token",
) -> Tensor:  # [B, T]
    """The log importance ratio each token's surrogate takes, per `level`:

    - `token`: `log π(y_t) − log π_old(y_t)` (PPO, GRPO).
    - `sequence`: the sequence's mean over its masked tokens, on every token, gradient through
      the mean (GSPO, Zheng et al. 2025, https://arxiv.org/abs/2507.18071; TRL
      `importance_sampling_level="sequence"`).
    - `sequence_token`: GSPO-token, the same value as `sequence` with the gradient of the token's
      own log-prob, `log π(y_t) − sg[log π(y_t)] + sg[seq]` (GSPO eq. 14; verl's `gspo` loss
      mode): the per-token advantages a distillation head gives keep their own token's
      gradient.

    Masked positions are 0 (the caller sanitised `logprobs` and `old_logprobs` there)."""
    check_choice("importance sampling level", level, RATIO_LEVELS)
    zero = torch.zeros_like(logprobs)
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, zero)  # [B, T]
    if level == "token":
        return log_ratio
    counts = response_mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    seq = log_ratio.sum(dim=-1, keepdim=True) / counts  # [B, 1]
    if level == "sequence":
        return torch.where(response_mask, seq.expand_as(log_ratio), zero)
    return torch.where(response_mask, logprobs - logprobs.detach() + seq.detach(), zero)


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
    loss_mode: str = "clip",
    ratio_level: str = "token",
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy-gradient surrogate: PPO's clipped ratio, CISPO's clipped weight or SAPO's gate.

    With `r` the importance ratio of `importance_log_ratio(..., ratio_level)`, per token:

    - `clip` (default): `l = max(-r*A, -clip(r, 1 - clip_low, 1 + clip_high)*A)` (Schulman et
      al. 2017, PPO; the asymmetric bounds of DAPO, Yu et al. 2025). With `dual_clip = c > 1`,
      tokens with A < 0 use `min(l, -c*A)` (Ye et al. 2020, "Mastering Complex Control in MOBA
      Games"; verl `compute_policy_loss`), which is TRL's two-sided `delta = c` (loss and
      gradient) whenever `c > 1 + clip_high`.
    - `cispo`: `l = -sg[min(r, 1 + clip_high)] * A * logprobs` (MiniMax-M1, 2025,
      https://arxiv.org/abs/2506.13585; TRL `loss_type="cispo"` with `epsilon_high = 1 +
      clip_high`): every token keeps a gradient, its weight capped.
    - `sapo`: `l = -σ(τ(r − 1)) * 4/τ * A`, τ = `sapo_temperatures[0]` for A > 0 and `[1]`
      otherwise (SAPO, Gao et al. 2025, https://arxiv.org/abs/2511.20347; TRL
      `loss_type="sapo"`): a soft gate in place of the hard clip.

    At r = 1 (the first update of an on-policy batch) the three have the same gradient,
    `-A ∇log π(y_t)` per token, at every `ratio_level`: they differ only off policy.
    The per-token losses are reduced by `masked_aggregate`.

    The log-ratio is clamped to [-20, 20] before the exp, as verl's `compute_policy_loss`
    (`verl/trainer/ppo/core_algos.py`: `negative_approx_kl = torch.clamp(log_prob -
    old_log_prob, min=-20.0, max=20.0)`), so a stale or corrupt `old_logprobs` cannot overflow
    the ratio to inf; a clamped token passes no gradient through the ratio.

    With `weights` (e.g. `truncated_importance_weights` for a stale batch, or a 0/1 token mask)
    each token's loss is multiplied by its weight before the aggregation, as verl's
    `rollout_is_weights`; the aggregation still counts every masked token.

    Args:
        logprobs: Log-probs of the sampled tokens under the current policy.
        old_logprobs: Log-probs under the proximal policy (the one that generated them, on
            policy).
        advantages: Per-token advantages (detached by the caller).
        response_mask: Tokens that carry loss.
        clip_low: Lower clip epsilon, in (0, 1) (`clip` only).
        clip_high: Upper clip epsilon, > 0 (`clip`; `cispo` caps its weight at 1 + clip_high).
        dual_clip: Dual-clip constant c > 1, or None for none (`clip` only).
        aggregation: A `masked_aggregate` mode.
        norm_length: Normaliser for `token_sum_norm`.
        weights: Per-token loss weights (detached), or None for all ones.
        loss_mode: One of `LOSS_MODES`.
        ratio_level: One of `RATIO_LEVELS` (see `importance_log_ratio`).
        sapo_temperatures: SAPO's (τ_pos, τ_neg), each > 0.

    Returns:
        `(loss, metrics)`: the scalar loss and detached scalar metrics over the masked tokens:
        `clipfrac` (`clip`: the clipped branch strictly taken, as verl's `pg_clipfrac`;
        `cispo`: the share of tokens whose weight is capped; `sapo`: 0), `ratio_mean`,
        `ratio_max`, and `dual_clipfrac` when `dual_clip` is set. With an empty mask every
        metric is 0.
    """
    check_choice("loss mode", loss_mode, LOSS_MODES)
    check_choice("importance sampling level", ratio_level, RATIO_LEVELS)
    check_range("clip_low", clip_low, 0.0, 1.0)
    check_range("clip_high", clip_high, 0.0)
    if dual_clip is not None:
        check_range("dual_clip", dual_clip, 1.0)
        if loss_mode != "clip":
            raise ValueError(
                f"dual_clip bounds the clipped surrogate; loss_mode {loss_mode!r} has none"
            )
    for name, temperature in zip(
        ("sapo temperature pos", "sapo temperature neg"), sapo_temperatures, strict=True
    ):
        check_range(name, temperature, 0.0)
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

    log_ratio = importance_log_ratio(lp, old, m, ratio_level)
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))  # [B, T]
    dual_taken = None
    if loss_mode == "clip":
        unclipped = -ratio * adv
        clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
        per_token = torch.maximum(unclipped, clipped)  # [B, T]
        capped = clipped > unclipped
        if dual_clip is not None:
            dual = -dual_clip * adv
            dual_taken = (adv < 0) & (dual < per_token)
            per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)
    elif loss_mode == "cispo":
        cap = 1.0 + clip_high
        per_token = -torch.clamp(ratio, max=cap).detach() * adv * lp
        capped = ratio > cap
    else:
        tau_pos, tau_neg = sapo_temperatures
        tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
        per_token = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
        capped = torch.zeros_like(m)
    if weights is not None:
        per_token = per_token * torch.where(m, weights.detach(), zero)
    per_token = torch.where(m, per_token, zero)
    loss = masked_aggregate(per_token, m, aggregation, norm_length)

    with torch.no_grad():
        n = m.sum().clamp(min=1).to(ratio.dtype)
        r = torch.where(m, ratio, zero)  # ratio > 0, so a 0 fill never wins the max
        metrics = {
            "clipfrac": (capped & m).sum() / n,
            "ratio_mean": r.sum() / n,
            "ratio_max": r.amax() if r.numel() else r.new_zeros(()),
        }
        if dual_taken is not None:
            metrics["dual_clipfrac"] = (dual_taken & m).sum() / n
    return loss, {k: v.detach() for k, v in metrics.items()}

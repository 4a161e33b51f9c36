"""Per-token estimators of KL(pi_theta || pi_ref) from log-probs of sampled tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_same_shape

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: Tensor,  # [B, T] policy log-probs of the sampled tokens
    ref_logprobs: Tensor,  # [B, T] reference log-probs of the same tokens
    kind: str,
    *,
    response_mask: Tensor | None = None,  # [B, T] bool or 0/1 float
) -> Tensor:  # [B, T]
    """Schulman's estimators of KL(pi_theta || pi_ref) for tokens sampled from pi_theta.

    With `log rho = ref_logprobs - logprobs` (J. Schulman, "Approximating KL Divergence", 2020,
    http://joschu.net/blog/kl-approx.html):

    - `k1 = -log rho`: unbiased, high variance, can be negative; its expected gradient is zero,
      so it belongs in the reward (KL-in-reward), not in the loss.
    - `k2 = (log rho)^2 / 2`: biased, low variance; its gradient is that of the forward KL.
    - `k3 = rho - 1 - log rho`: unbiased and non-negative (verl's `low_var_kl`, unclamped).

    Args:
        logprobs: Log-probs under the policy being trained.
        ref_logprobs: Log-probs under the reference policy.
        kind: `"k1"`, `"k2"` or `"k3"`.
        response_mask: Optional; where given, off-mask entries are exactly 0 and their inputs
            (even NaN) reach neither value nor gradient.

    Returns:
        The per-token estimate.
    """
    check_choice("KL estimator kind", kind, KL_KINDS)
    check_same_shape(("logprobs", logprobs), ("ref_logprobs", ref_logprobs))
    mask = None
    if response_mask is not None:
        check_same_shape(("logprobs", logprobs), ("response_mask", response_mask))
        mask = as_bool_mask(response_mask)
        zero = torch.zeros_like(logprobs)
        logprobs = torch.where(mask, logprobs, zero)
        ref_logprobs = torch.where(mask, ref_logprobs, zero)
    log_rho = ref_logprobs - logprobs
    if kind == "k1":
        kl = -log_rho
    elif kind == "k2":
        kl = 0.5 * log_rho.square()
    else:
        kl = torch.expm1(log_rho) - log_rho  # expm1: no cancellation near rho = 1
    if mask is not None:
        kl = torch.where(mask, kl, torch.zeros_like(kl))
    return kl

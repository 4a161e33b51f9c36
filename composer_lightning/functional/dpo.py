"""Sigmoid DPO loss with conservative-DPO label smoothing, on sequence log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_ndim, check_range, check_same_shape


def _check(
    chosen_logprobs: Tensor,
    rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    beta: float,
) -> None:
    check_range("beta", beta, 0.0)
    check_ndim("chosen_logprobs", chosen_logprobs, (1,))
    check_same_shape(
        ("chosen_logprobs", chosen_logprobs),
        ("rejected_logprobs", rejected_logprobs),
        ("ref_chosen_logprobs", ref_chosen_logprobs),
        ("ref_rejected_logprobs", ref_rejected_logprobs),
    )


def dpo_loss(
    chosen_logprobs: Tensor,  # [N] policy sequence log-probs of the chosen responses
    rejected_logprobs: Tensor,  # [N] policy sequence log-probs of the rejected responses
    ref_chosen_logprobs: Tensor,  # [N] reference sequence log-probs, chosen
    ref_rejected_logprobs: Tensor,  # [N] reference sequence log-probs, rejected
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Tensor:  # []
    """Sigmoid DPO loss, mean over pairs.

    `z = (pi_c - ref_c) - (pi_r - ref_r)`,
    `L = -(1 - eps) * logsigmoid(beta * z) - eps * logsigmoid(-beta * z)`
    (Rafailov et al. 2023, "Direct Preference Optimization", https://arxiv.org/abs/2305.18290;
    label smoothing eps is conservative DPO, Mitchell 2023, as in TRL `DPOTrainer`
    `loss_type="sigmoid"`). eps = 0 is plain DPO. Zero pairs give 0, attached to the graph.

    Args:
        chosen_logprobs: Policy log-probs summed over each chosen response.
        rejected_logprobs: Policy log-probs summed over each rejected response.
        ref_chosen_logprobs: Reference log-probs, chosen.
        ref_rejected_logprobs: Reference log-probs, rejected.
        beta: Inverse temperature of the implicit reward, > 0.
        label_smoothing: Probability eps in [0, 0.5) that a preference label is flipped.

    Returns:
        The scalar loss.
    """
    _check(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs, beta)
    check_range("label_smoothing", label_smoothing, 0.0, 0.5, low_closed=True)
    z = (chosen_logprobs - ref_chosen_logprobs) - (rejected_logprobs - ref_rejected_logprobs)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * z)  # [N]
    if label_smoothing > 0:
        losses = losses - label_smoothing * F.logsigmoid(-beta * z)
    return losses.sum() / max(z.numel(), 1)


def dpo_rewards(
    chosen_logprobs: Tensor,  # [N]
    rejected_logprobs: Tensor,  # [N]
    ref_chosen_logprobs: Tensor,  # [N]
    ref_rejected_logprobs: Tensor,  # [N]
    *,
    beta: float = 0.1,
) -> tuple[Tensor, Tensor]:  # [N], [N]
    """DPO implicit rewards `beta * (pi - ref)` per pair, detached, for logging.

    Reward accuracy is `(chosen > rejected).float().mean()` and the margin
    `(chosen - rejected).mean()`, as TRL logs them.

    Args:
        chosen_logprobs: Policy log-probs summed over each chosen response.
        rejected_logprobs: Policy log-probs summed over each rejected response.
        ref_chosen_logprobs: Reference log-probs, chosen.
        ref_rejected_logprobs: Reference log-probs, rejected.
        beta: The DPO beta, > 0.

    Returns:
        `(chosen_rewards, rejected_rewards)`.
    """
    _check(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs, beta)
    with torch.no_grad():
        chosen = beta * (chosen_logprobs - ref_chosen_logprobs)
        rejected = beta * (rejected_logprobs - ref_rejected_logprobs)
    return chosen, rejected

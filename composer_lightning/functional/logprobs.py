"""Per-token log-probs and entropies from full logits (the reference for `chunked.py`).

Alignment follows the `RolloutBatch` contract: column t describes token t given tokens < t, so
it comes from the logits at position t - 1; column 0 has no predictor and is 0. Logits may be
-inf (a masked vocabulary): `scaled_logits` raises them to a finite floor, so the masked entries
get probability exactly 0 and both values and gradients stay finite.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import as_bool_mask, check_ndim, check_range, check_same_shape, shape_str


def upcast(x: Tensor) -> Tensor:
    """float16/bfloat16 to float32 (softmax statistics in half precision are too coarse)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def logit_floor(dtype: torch.dtype) -> float:
    """The finite floor -inf logits are raised to: `finfo(dtype).min / 4`, which leaves room for
    the log-sum-exp subtraction in log_softmax without overflow."""
    return torch.finfo(dtype).min / 4


class _FloorNegInf(torch.autograd.Function):
    """Raise -inf to `torch.finfo(dtype).min / 4`; the gradient passes through unchanged.

    A plain `x.clamp(min=...)` would save its input for the backward: one more `[B, T, V]`
    float32 tensor held until the backward, per call; this saves nothing. (In place with
    `mark_dirty` would also spare the transient copy, but breaks `torch.compile` graphs.) The
    floored entries get probability exactly 0, so everything downstream sends them a gradient
    of exactly 0 anyway (unless a floored entry is itself the gathered target, whose log-prob
    is then a huge finite negative).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clamp(min=logit_floor(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def scaled_logits(
    logits: Tensor,  # [..., V]
    temperature: float,
) -> Tensor:  # [..., V]
    """`upcast(logits) / temperature` with -inf raised to a large finite negative.

    With -inf left in, a fully masked entry gives `0 * (-inf) = NaN` in an entropy or KL term
    and `logaddexp(-inf, -inf)` a NaN gradient. The floor is applied after the temperature
    (a floor before it would overflow back to -inf for temperature < 1/4); finite logits pass
    through bit-identically, values and gradients.

    Args:
        logits: Logits, any float dtype.
        temperature: Softmax temperature, > 0 (checked by the caller).

    Returns:
        The scaled logits, float32 for half-precision input.
    """
    out = _FloorNegInf.apply(upcast(logits) / temperature)  # type: ignore[no-untyped-call]
    return cast(Tensor, out)  # torch types `Function.apply` as untyped


def check_logits_and_ids(logits: Tensor, input_ids: Tensor, logits_name: str = "logits") -> None:
    """Require `[B, T, *]` logits (or hidden states) and `[B, T]` token ids."""
    check_ndim(logits_name, logits, (3,))
    check_ndim("input_ids", input_ids, (2,))
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"{logits_name} {shape_str(logits)} and input_ids {shape_str(input_ids)} must agree "
            "on [B, T]"
        )


def logprobs_from_logits(
    logits: Tensor,  # [B, T, V]
    input_ids: Tensor,  # [B, T] long
    temperature: float = 1.0,
) -> Tensor:  # [B, T]
    """Log-prob of each token under the (temperature-scaled) distribution that predicts it.

    `out[b, t] = log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]`, `out[:, 0] = 0`.
    The temperature is the sampling temperature, so these are the sampling distribution's
    log-probs, as vLLM reports them with processed log-probs (and as TRL/verl compute them).

    Args:
        logits: Model logits at every position.
        input_ids: The token sequence the logits were computed on.
        temperature: Sampling temperature, > 0.

    Returns:
        Per-token log-probs (float32 for half-precision logits).
    """
    check_range("temperature", temperature, 0.0)
    check_logits_and_ids(logits, input_ids)
    x = scaled_logits(logits[:, :-1], temperature)  # [B, T-1, V]
    # x[id] - logsumexp(x) avoids materialising a second [B, T, V] log_softmax tensor.
    lp = x.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)
    return F.pad(lp, (1, 0))


def entropy_from_logits(
    logits: Tensor,  # [B, T, V]
    temperature: float = 1.0,
) -> Tensor:  # [B, T]
    """Entropy of the distribution that predicts each token, aligned like the log-probs.

    `out[b, t] = H(softmax(logits[b, t - 1] / temperature))`, `out[:, 0] = 0`.

    Args:
        logits: Model logits at every position.
        temperature: Sampling temperature, > 0.

    Returns:
        Per-token entropies in nats.
    """
    check_range("temperature", temperature, 0.0)
    check_ndim("logits", logits, (3,))
    lp = torch.log_softmax(scaled_logits(logits[:, :-1], temperature), dim=-1)  # [B, T-1, V]
    return F.pad(-(lp.exp() * lp).sum(dim=-1), (1, 0))


def sequence_logprobs(
    logprobs: Tensor,  # [N, T]
    response_mask: Tensor,  # [N, T] bool or 0/1 float
) -> Tensor:  # [N]
    """Sum of the per-token log-probs over each sequence's masked (response) tokens.

    Args:
        logprobs: Per-token log-probs.
        response_mask: Tokens to sum; others (even NaN) reach neither value nor gradient.

    Returns:
        Sequence log-probs.
    """
    check_ndim("logprobs", logprobs, (2,))
    check_same_shape(("logprobs", logprobs), ("response_mask", response_mask))
    m = as_bool_mask(response_mask)
    return torch.where(m, logprobs, torch.zeros_like(logprobs)).sum(dim=-1)

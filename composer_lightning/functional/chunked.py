"""Log-probs and entropies from hidden states and the LM head, in checkpointed token chunks.

For large vocabularies the `[B, T, V]` logits dominate memory. These functions compute the same
values as `logprobs_from_logits(hidden @ lm_head_weight.T)` and `entropy_from_logits(...)`, one
chunk of tokens at a time under `torch.utils.checkpoint`: only the `[chunk, V]` logits of one
chunk are alive at once, in the forward and again (recomputed) in the backward, so peak memory
grows with `chunk_size`, not with T x V. (The same trick as Liger-Kernel's fused linear
cross-entropy, without the fused kernel.) An LM head with a bias is not supported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ._checks import check_ndim, check_range, shape_str
from .logprobs import check_logits_and_ids, upcast


def _chunk_logprobs(
    hidden: Tensor,  # [n, H]
    weight: Tensor,  # [V, H]
    targets: Tensor,  # [n] long
    temperature: float,
) -> Tensor:  # [n]
    x = upcast(hidden @ weight.T) / temperature  # [n, V]
    return x.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)


def _chunk_entropy(
    hidden: Tensor,  # [n, H]
    weight: Tensor,  # [V, H]
    targets: Tensor,  # [n], unused
    temperature: float,
) -> Tensor:  # [n]
    lp = torch.log_softmax(upcast(hidden @ weight.T) / temperature, dim=-1)  # [n, V]
    return -(lp.exp() * lp).sum(dim=-1)


def _chunked(
    fn: Callable[[Tensor, Tensor, Tensor, float], Tensor],
    hidden: Tensor,  # [B, T, H]
    weight: Tensor,  # [V, H]
    input_ids: Tensor,  # [B, T]
    temperature: float,
    chunk_size: int,
) -> Tensor:  # [B, T]
    check_range("temperature", temperature, 0.0)
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    check_ndim("lm_head_weight", weight, (2,))
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight {shape_str(weight)} must be [V, H] for hidden {shape_str(hidden)}"
        )
    b, t, h = hidden.shape
    flat_hidden = hidden[:, :-1].reshape(-1, h)  # [B*(T-1), H]; position t-1 predicts token t
    flat_targets = input_ids[:, 1:].reshape(-1)  # [B*(T-1)]
    pieces = [
        checkpoint(
            fn,
            flat_hidden[i : i + chunk_size],
            weight,
            flat_targets[i : i + chunk_size],
            temperature,
            use_reentrant=False,
        )
        for i in range(0, flat_hidden.shape[0], chunk_size)
    ]
    if not pieces:  # T <= 1 or B == 0: nothing is predicted
        return torch.zeros(b, t, dtype=upcast(hidden[:0]).dtype, device=hidden.device)
    return F.pad(torch.cat(pieces).view(b, t - 1), (1, 0))


def chunked_logprobs_from_hidden(
    hidden: Tensor,  # [B, T, H] final hidden states (after the last norm)
    lm_head_weight: Tensor,  # [V, H]
    input_ids: Tensor,  # [B, T] long
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:  # [B, T]
    """`logprobs_from_logits(hidden @ lm_head_weight.T, input_ids, temperature)`, chunked.

    Args:
        hidden: Hidden states that the LM head maps to logits.
        lm_head_weight: The LM head (or tied embedding) weight.
        input_ids: The token sequence.
        temperature: Sampling temperature, > 0.
        chunk_size: Tokens (over B x T) per checkpointed chunk.

    Returns:
        Per-token log-probs, column 0 = 0.
    """
    check_logits_and_ids(hidden, input_ids, "hidden")
    return _chunked(_chunk_logprobs, hidden, lm_head_weight, input_ids, temperature, chunk_size)


def chunked_entropy_from_hidden(
    hidden: Tensor,  # [B, T, H] final hidden states (after the last norm)
    lm_head_weight: Tensor,  # [V, H]
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:  # [B, T]
    """`entropy_from_logits(hidden @ lm_head_weight.T, temperature)`, chunked.

    Args:
        hidden: Hidden states that the LM head maps to logits.
        lm_head_weight: The LM head (or tied embedding) weight.
        temperature: Sampling temperature, > 0.
        chunk_size: Tokens (over B x T) per checkpointed chunk.

    Returns:
        Per-token entropies in nats, column 0 = 0.
    """
    check_ndim("hidden", hidden, (3,))
    dummy_ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    return _chunked(_chunk_entropy, hidden, lm_head_weight, dummy_ids, temperature, chunk_size)

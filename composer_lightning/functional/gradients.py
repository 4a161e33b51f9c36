"""Each head's gradient at the policy's final hidden states, and its share of the whole.

GradNorm (Chen et al. 2018, https://arxiv.org/abs/1711.02257) measures each task's gradient at
the last layer all tasks share, not over every parameter. Here that layer is the policy's final
hidden states `[B, T, H]` (after the last norm), which every head reads (through the log-probs,
the entropies or the LM head): `g_h = ∂piece_h / ∂states` is exact for that layer, costs one
backward through the chunked LM head per head (never through the transformer) and needs no
parameter-gradient handling under FSDP2.

The pieces' gradients are summarised by their Gram matrix `G_hk = <g_h, g_k>` (summed over
every tensor the gradient is taken at: these are disjoint variables, so dot products add). With
`g = Σ_h g_h`, `‖g‖² = Σ_hk G_hk` and `share_h = <g_h, g> / ‖g‖² = Σ_k G_hk / Σ_jk G_jk`: the
shares sum to 1 exactly, and a negative one is a head pulling against the others. Because the
Gram matrix of disjoint pieces (micro-batches, ranks) is the sum of theirs, it is what is
reduced; norms and shares are taken from the sum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .logprobs import upcast


def hidden_gradients(
    pieces: dict[str, Tensor],  # name -> [] scalar
    at: list[Tensor],  # each [B_i, T_i, H], with grad
) -> dict[str, list[Tensor | None]]:
    """`∂piece / ∂at[i]` for each piece; None where a piece does not reach `at[i]`.

    The graph is retained (`retain_graph=True`), so the loss these pieces sum to can still be
    backpropagated; `.grad` of nothing is touched (`torch.autograd.grad`)."""
    wanted = [i for i, t in enumerate(at) if t.requires_grad]
    out: dict[str, list[Tensor | None]] = {}
    for name, piece in pieces.items():
        grads: list[Tensor | None] = [None] * len(at)
        if piece.requires_grad and wanted:
            found = torch.autograd.grad(
                piece, [at[i] for i in wanted], retain_graph=True, allow_unused=True
            )
            for i, g in zip(wanted, found, strict=True):
                grads[i] = g
        out[name] = grads
    return out


def gradient_gram(grads: dict[str, list[Tensor | None]]) -> Tensor:  # [H, H] float64
    """`G_hk = Σ_i <g_h[i], g_k[i]>` in the order of `grads` (half precision summed in fp32)."""
    names = list(grads)
    gram = torch.zeros(len(names), len(names), dtype=torch.float64)
    for a, ha in enumerate(names):
        for b in range(a, len(names)):
            dot = 0.0
            for x, y in zip(grads[ha], grads[names[b]], strict=True):
                if x is not None and y is not None:
                    dot += float(torch.sum(upcast(x) * upcast(y)))
            gram[a, b] = gram[b, a] = dot
    return gram


def scaled_gram(gram: Tensor, scales: Tensor) -> Tensor:  # [H, H]
    """The Gram matrix of the gradients `s_h · g_h` (pieces whose weights are scaled by `s_h`:
    a head's piece is positively homogeneous in its weight)."""
    return gram * scales[:, None] * scales[None, :]


def gradient_shares(gram: Tensor, names: list[str]) -> dict[str, float]:
    """`<name>/grad_norm` = ‖g_h‖ and `<name>/grad_share` = <g_h, g> / ‖g‖² (0 when g = 0).

    Args:
        gram: `[H, H]` the pieces' Gram matrix, in the order of `names`.
        names: the heads' names.
    """
    total = float(gram.sum())
    out: dict[str, float] = {}
    for h, name in enumerate(names):
        out[f"{name}/grad_norm"] = math.sqrt(max(float(gram[h, h]), 0.0))
        out[f"{name}/grad_share"] = float(gram[h].sum()) / total if total > 0 else 0.0
    return out

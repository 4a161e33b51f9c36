"""Log-probs from hidden states in tiles of the vocabulary: memory falls with the tile, time not.

`lm_head_in_chunks` (`chunked.py`) cuts the `[N, V]` logits into chunks of tokens. Each chunk's
backward adds a rank-`n` update `g.T @ h` into the whole `[V, H]` weight gradient, which is read
and written once per chunk: at a small chunk that traffic, not the arithmetic, sets the pace
(`bench/memory.py --chunk-mib`: 1.59x slower at 8 MiB than at 256 MiB on Qwen's vocabulary).

Here the cut runs across the vocabulary instead. A tile is `[R, Vt]` logits of R rows (all of
them, where the budget allows) and Vt vocabulary entries:

- forward: an online log-sum-exp over the tiles (each tile's, fused, added with
  `logaddexp`), and the targets' logits picked from the tile that holds them; only the rows'
  `[R]` log-normalisers are saved;
- backward: each tile's logits are recomputed, its gradient is the closed form
  `(scatter(grad, targets) - grad.sum() * softmax(x)) / temperature` with the saved
  log-normaliser (`logprobs_logits_grad`, which the token chunks' baseline takes over whole
  rows), and the LM head's two matmuls follow: `grad_W[tile] = g.T @ h`, a product over all R
  rows written once into its own rows of the weight gradient, and `grad_h += g @ W[tile]`.

Both passes compute a tile's logits with the same matmul shape, so the softmax the backward
rebuilds is the one the forward normalised. The arithmetic is that of the chunked path (one
logits matmul forward; logits, `grad_h` and `grad_W` backward); only the order differs.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from .logprobs import logit_floor, scaled_logits, upcast

#: The narrowest vocabulary tile a budget is cut into before the rows are split too.
MIN_TILE = 256


def tile_shape(n_rows: int, vocab: int, elements: int) -> tuple[int, int]:
    """`(rows, tile)` of the `[rows, tile]` logits a budget of `elements` allows: all rows
    where a tile of at least `MIN_TILE` (or the whole vocabulary) still fits, else fewer rows."""
    rows = max(1, min(n_rows, elements // min(MIN_TILE, vocab)))
    return rows, max(1, min(vocab, elements // rows))


def head_dtype(hidden: Tensor, weight: Tensor) -> tuple[str, torch.dtype, bool]:
    """`(device type, the dtype the LM head's matmuls run in, autocast on)`: autocast's dtype
    where it is on, as autocast would run them; else the inputs', which must then agree."""
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    if not autocast and weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) and lm_head_weight ({weight.dtype}) must have the same "
            "dtype (or run under autocast)"
        )
    return device, torch.get_autocast_dtype(device) if autocast else hidden.dtype, autocast


def logprobs_logits_grad(
    logits: Tensor,  # [n, V] or a tile [n, Vt] of it
    grad: Tensor,  # [n] or [n, K]
    targets: Tensor,  # like grad, long
    temperature: float,
    lse: Tensor | None = None,  # [n] the rows' log-normaliser, for a tile
    offset: int = 0,  # the tile's first vocabulary id
) -> Tensor:  # like logits, float32 (float64 for float64 logits)
    """The gradient of `(lp * grad).sum()` with respect to the logits, where `lp` are the
    log-probs at `targets` of `softmax(x)`, `x` the scaled, floored logits (`scaled_logits`):
    `(scatter(grad, targets) - grad.sum(-1) * softmax(x)) / temperature`, on one buffer. One
    target a row (`[n]`) or several (`[n, K]`; a repeated id gets each share). With `lse`,
    `logits` are the columns `offset, offset + 1, ...` of the full rows: the softmax is
    `exp(x - lse)`, and only the targets in the tile are scattered."""
    x = upcast(logits)
    x = x.clone() if x is logits else x  # the buffer everything below writes into
    if temperature != 1.0:
        x.div_(temperature)
    x.clamp_(min=logit_floor(x.dtype))  # as `scaled_logits` floors -inf
    p = torch.softmax(x, dim=-1) if lse is None else x.sub_(lse[:, None]).exp_()
    del x
    scale = grad.to(p.dtype).reshape(p.shape[0], -1) / temperature  # [n, K]
    p.mul_(-scale.sum(-1, keepdim=True))
    at = targets.reshape(p.shape[0], -1) - offset
    inside = (at >= 0) & (at < p.shape[1])
    return p.scatter_add_(-1, at.clamp(0, p.shape[1] - 1), scale * inside)


class _TiledLogprobs(torch.autograd.Function):
    """Log-probs of `softmax(scaled_logits(hidden @ weight.T, T))` at `targets` (`[N]` or
    `[N, K]`), in `[rows, tile]` pieces (see the module docstring). Under autocast the matmuls
    run in the autocast dtype, as in `_LMHeadInChunks`. Not twice differentiable."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,  # [N, H]
        weight: Tensor,  # [V, H]
        targets: Tensor,  # [N] or [N, K] long
        temperature: float,
        elements: int,
    ) -> Tensor:  # like targets, float
        device, dtype, _ = head_dtype(hidden, weight)
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, tile = tile_shape(n, vocab, elements)
        out_dtype = upcast(hidden[:0]).dtype
        tg = targets if targets.dim() == 2 else targets[:, None]  # [N, K]
        lse = torch.empty(n, dtype=out_dtype, device=hidden.device)
        picked = torch.zeros(tg.shape, dtype=out_dtype, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(device, enabled=False):
            for r in range(0, n, rows):
                h, t = hidden[r : r + rows].to(dtype), tg[r : r + rows]
                norm = torch.full((h.shape[0],), -torch.inf, dtype=out_dtype, device=h.device)
                for v in range(0, vocab, tile):
                    x = scaled_logits(h @ w[v : v + tile].T, temperature)  # [rows, tile]
                    norm = torch.logaddexp(norm, torch.logsumexp(x, dim=-1))  # online
                    inside = (t >= v) & (t < v + x.shape[1])
                    at = x.gather(-1, (t - v).clamp(0, x.shape[1] - 1))
                    picked[r : r + rows] = torch.where(inside, at, picked[r : r + rows])
                lse[r : r + rows] = norm
        ctx.save_for_backward(hidden, weight, tg, lse)
        ctx.temperature, ctx.shape = temperature, (rows, tile)
        ctx.autocast = (device, dtype)
        return (picked - lse[:, None]).view(*targets.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, tg, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        device, dtype = ctx.autocast
        temperature, (rows, tile) = ctx.temperature, ctx.shape
        n, vocab = hidden.shape[0], weight.shape[0]
        grad = grad.reshape(tg.shape)  # [N, K]
        w = weight.to(dtype)
        grad_h = (
            torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if need_h else None
        )
        grad_w = torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_w else None
        with torch.autocast(device, enabled=False):
            for r in range(0, n, rows):
                h, t, gr = hidden[r : r + rows].to(dtype), tg[r : r + rows], grad[r : r + rows]
                for v in range(0, vocab, tile):
                    wv = w[v : v + tile]
                    g = logprobs_logits_grad(h @ wv.T, gr, t, temperature, lse[r : r + rows], v)
                    g = g.to(dtype)  # [rows, tile]
                    if grad_h is not None and grad_h.dtype == dtype:
                        grad_h[r : r + rows].addmm_(g, wv)
                    elif grad_h is not None:  # bf16 products summed in fp32
                        grad_h[r : r + rows] += g @ wv
                    if grad_w is None:
                        continue
                    if grad_w.dtype == dtype:
                        grad_w[v : v + tile].addmm_(g.T, h)
                    else:  # an fp32 master weight under bf16 autocast: as autocast's backward
                        grad_w[v : v + tile] += g.T @ h
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None


def tiled_logprobs(
    hidden: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    targets: Tensor,  # [N] or [N, K] long
    temperature: float,
    elements: int,
) -> Tensor:  # like targets: float32 (float64 for float64 hidden)
    """Log-probs of `softmax(hidden @ weight.T / temperature)` (logits floored as
    `scaled_logits` floors them) at `targets`, with gradients for `hidden` and `weight`, never
    holding more than about `elements` logits at once (see the module docstring). With N = 0
    the result is empty and still attached to the graph."""
    out = _TiledLogprobs.apply(hidden, weight, targets, temperature, elements)  # type: ignore[no-untyped-call]  # untyped in torch
    return cast(Tensor, out)

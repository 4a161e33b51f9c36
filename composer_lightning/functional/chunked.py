"""Log-probs, entropies and the generalised JSD from hidden states, in recomputed chunks.

For large vocabularies the `[B, T, V]` logits dominate memory. These functions compute the same
values as `logprobs_from_logits(hidden @ lm_head_weight.T)`, `entropy_from_logits(...)` and
`generalized_jsd_per_token(student_hidden @ student_weight.T, teacher_hidden @
teacher_weight.T)`, one chunk of tokens at a time (`lm_head_in_chunks`): only the `[chunk, V]`
logits of one chunk are alive at once, in the forward and again (recomputed) in the backward,
so peak memory grows with `chunk_size`, not with T x V, and the LM head's weight gradient is
summed in place into one buffer. (The same trick as Liger-Kernel's fused linear cross-entropy
and fused linear JSD, without the fused kernels: the price is one extra LM-head matmul per
chunk in the backward.) An LM head with a bias is not supported.

The log-probs, the step's hot path, are cut across the vocabulary instead, in tiles of the same
memory (`chunk_size` x V logits; `vocab_tiles.py`): their gradient has a closed form given each
row's log-normaliser, so the weight's gradient is written tile by tile, once, where a chunk of
tokens adds into all of it. The entropies and the JSD keep the token chunks.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import as_bool_mask, check_ndim, check_range, shape_str
from .jsd import check_jsd_options, generalized_jsd_per_token
from .logprobs import check_logits_and_ids, scaled_logits, upcast
from .vocab_tiles import head_dtype, tiled_logprobs

#: What a chunk function returns: one tensor, or a tuple whose first is differentiated.
_Out = TypeVar("_Out", bound=Tensor | tuple[Tensor, ...])


class _LMHeadInChunks(torch.autograd.Function):
    """`cat([fn(hidden[c] @ weight.T, *rows[c], *consts) for each chunk c of rows])`, with
    one chunk's `[n, V]` logits alive at a time, and the weight's gradient summed in place.

    The forward runs `fn` without grad and saves only its inputs. The backward recomputes each
    chunk's logits, takes `fn`'s gradient with respect to them (autograd, on `[n, V]` only), and
    applies the LM head's two matmuls itself: `grad_hidden[c] = g @ W` and
    `grad_W += g.T @ hidden[c]` into ONE `[V, H]` buffer (`addmm_`). Under
    `torch.utils.checkpoint` per chunk, autograd made a new `[V, H]` gradient per chunk and
    summed it into the previous one: at a 151,936 x 896 head that is two 545 MB tensors
    per chunk, written and read once each. (Liger-Kernel's fused linear losses keep one
    buffer the same way.)

    Under autocast the matmuls run in the autocast dtype, as autocast would run them, and `fn`
    under the same autocast state in the forward and in the backward. Only `fn`'s first output
    has a gradient; the others are marked non-differentiable. Not twice differentiable.

    Where `grad_fn` is given, the backward takes the logits' gradient from it,
    `grad_fn(logits, grad[c], *rows[c], *consts)`, in place of autograd through `fn`: a few
    fused passes for a function whose gradient is known in closed form (a log-prob's,
    `(onehot - softmax) / T`: `logprobs_logits_grad`). Autograd through `fn` walks the `[n, V]`
    logits about ten times (the upcast, the temperature, the floor, the log-sum-exp and their
    backwards). In bf16 that elementwise work is a large share of the LM head's backward: the
    closed form made it 1.09x (SmolLM2) and 1.28x (Gemma 3) faster on 2 threads, 1.96x on one;
    in fp32, where the matmuls dominate, it was level. (The log-probs now run in vocabulary
    tiles, `vocab_tiles.py`; this pair stays `bench/roofline.py`'s baseline for them.)
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        fn: Callable[..., Tensor | tuple[Tensor, ...]],
        grad_fn: Callable[..., Tensor] | None,
        chunk_size: int,
        n_rows: int,
        *rest: Any,
    ) -> Tensor | tuple[Tensor, ...]:
        rows, consts = rest[:n_rows], rest[n_rows:]
        device, dtype, autocast = head_dtype(hidden, weight)
        ctx.fn, ctx.grad_fn, ctx.chunk_size, ctx.consts = fn, grad_fn, chunk_size, consts
        ctx.autocast, ctx.dtype = (device, dtype, autocast), dtype
        ctx.save_for_backward(hidden, weight, *rows)
        w = weight.to(dtype)
        pieces: list[tuple[Tensor, ...]] = []
        for i in range(0, max(hidden.shape[0], 1), chunk_size):
            c = slice(i, i + chunk_size)
            with torch.autocast(device, enabled=False):
                logits = hidden[c].to(dtype) @ w.T  # [n, V]
            out = fn(logits, *(r[c] for r in rows), *consts)
            pieces.append(out if isinstance(out, tuple) else (out,))
        outs = tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))
        ctx.mark_non_differentiable(*outs[1:])
        ctx.single = not isinstance(out, tuple)
        return outs[0] if ctx.single else outs

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        hidden, weight, *rows = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        device, dtype, autocast = ctx.autocast
        w = weight.to(dtype)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_w else None
        for i in range(0, hidden.shape[0], ctx.chunk_size):
            c = slice(i, i + ctx.chunk_size)
            h = hidden[c].to(dtype)
            with torch.autocast(device, enabled=False):
                logits = h @ w.T  # [n, V]
            if ctx.grad_fn is not None:
                g = ctx.grad_fn(logits, grad[c], *(r[c] for r in rows), *ctx.consts)
            else:
                logits.requires_grad_()
                with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=autocast):
                    out = ctx.fn(logits, *(r[c] for r in rows), *ctx.consts)
                    out = out[0] if isinstance(out, tuple) else out
                (g,) = torch.autograd.grad(out, logits, grad[c])
                del out
            del logits
            g = g.to(dtype)
            with torch.autocast(device, enabled=False):
                if grad_h is not None:
                    grad_h[c] = g @ w
                if grad_w is None:
                    continue
                if grad_w.dtype == dtype:
                    grad_w.addmm_(g.T, h)
                else:  # an fp32 master weight under bf16 autocast: as autocast's backward does
                    grad_w += g.T @ h
        return grad_h, grad_w, None, None, None, None, *([None] * (len(rows) + len(ctx.consts)))


def lm_head_in_chunks(
    fn: Callable[..., _Out],
    hidden: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    rows: tuple[Tensor, ...] = (),  # each [N, ...], sliced with hidden
    consts: tuple[Any, ...] = (),
    chunk_size: int = 1024,
    grad_fn: Callable[..., Tensor] | None = None,
) -> _Out:  # each [N, ...]
    """`fn(hidden @ weight.T, *rows, *consts)` computed `chunk_size` rows at a time, values and
    gradients (see `_LMHeadInChunks`). `fn` maps `[n, V]` logits (and the rows' slices) to per-row
    outputs; only its first output is differentiable. `grad_fn(logits, grad, *rows, *consts)`,
    where given, returns the `[n, V]` gradient of `(fn(...)[0] * grad).sum()` with respect to
    the logits, in place of autograd through `fn`. With N = 0 one empty chunk still runs, so
    the result is attached to the graph."""
    args = (hidden, weight, fn, grad_fn, chunk_size, len(rows), *rows, *consts)
    out = _LMHeadInChunks.apply(*args)  # type: ignore[no-untyped-call]  # untyped in torch
    return cast(_Out, out)  # what `fn` returns, concatenated over chunks


def _chunk_logprobs(
    logits: Tensor,  # [n, V]
    targets: Tensor,  # [n] long
    temperature: float,
) -> Tensor:  # [n]
    """One chunk of tokens' log-probs: the benches' token-chunk baseline (`bench/roofline.py`,
    `bench/lm_head.py`); the library's log-probs run in vocabulary tiles (`_tiled_logprobs`)."""
    x = scaled_logits(logits, temperature)  # [n, V]
    return x.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)


def _chunk_entropy(
    logits: Tensor,  # [n, V]
    targets: Tensor,  # [n], unused
    temperature: float,
) -> Tensor:  # [n]
    lp = torch.log_softmax(scaled_logits(logits, temperature), dim=-1)  # [n, V]
    return -(lp.exp() * lp).sum(dim=-1)


def _check_chunk_size(chunk_size: int) -> None:
    try:  # operator.index accepts Python and NumPy integers, rejects 2.0 and "2"
        ok = operator.index(chunk_size) >= 1 and not isinstance(chunk_size, bool)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def _tiled_logprobs(
    hidden: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    targets: Tensor,  # [N] long
    temperature: float,
    chunk_size: int,
) -> Tensor:  # [N]
    """The rows' log-probs in vocabulary tiles of `chunk_size` x V logits (`vocab_tiles.py`)."""
    return tiled_logprobs(hidden, weight, targets, temperature, chunk_size * weight.shape[0])


def _chunked_entropy(
    hidden: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    targets: Tensor,  # [N], unused
    temperature: float,
    chunk_size: int,
) -> Tensor:  # [N]
    """The rows' entropies in chunks of `chunk_size` tokens."""
    return lm_head_in_chunks(_chunk_entropy, hidden, weight, (targets,), (temperature,), chunk_size)


def _chunked(
    values_of: Callable[[Tensor, Tensor, Tensor, float, int], Tensor],
    hidden: Tensor,  # [B, T, H]
    weight: Tensor,  # [V, H]
    input_ids: Tensor,  # [B, T]
    temperature: float,
    chunk_size: int,
    mask: Tensor | None,  # [B, T] bool or 0/1 float; None = every token
) -> Tensor:  # [B, T]
    check_range("temperature", temperature, 0.0)
    _check_chunk_size(chunk_size)
    check_ndim("lm_head_weight", weight, (2,))
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight {shape_str(weight)} must be [V, H] for hidden {shape_str(hidden)}"
        )
    b, t, h = hidden.shape
    if mask is not None and tuple(mask.shape) != (b, t):
        raise ValueError(f"mask {shape_str(mask)} must be [B, T] = {[b, t]} like hidden")
    out_dtype = upcast(hidden[:0]).dtype
    if t <= 1 or b == 0:  # nothing is predicted
        return torch.zeros(b, t, dtype=out_dtype, device=hidden.device)
    # position t-1 predicts token t; only the selected tokens reach the LM head
    sel = None if mask is None else as_bool_mask(mask)[:, 1:]  # [B, T-1]
    flat_hidden = hidden[:, :-1].reshape(-1, h) if sel is None else hidden[:, :-1][sel]  # [N, H]
    flat_targets = input_ids[:, 1:].reshape(-1) if sel is None else input_ids[:, 1:][sel]  # [N]
    values = values_of(flat_hidden, weight, flat_targets, temperature, chunk_size)  # [N]
    if sel is None:
        return F.pad(values.view(b, t - 1), (1, 0))
    zeros = torch.zeros(b, t - 1, dtype=values.dtype, device=values.device)
    return F.pad(zeros.masked_scatter(sel, values), (1, 0))


def chunked_logprobs_from_hidden(
    hidden: Tensor,  # [B, T, H] final hidden states (after the last norm)
    lm_head_weight: Tensor,  # [V, H]
    input_ids: Tensor,  # [B, T] long
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: Tensor | None = None,  # [B, T] bool or 0/1 float
) -> Tensor:  # [B, T]
    """`logprobs_from_logits(hidden @ lm_head_weight.T, input_ids, temperature)`, chunked.

    Args:
        hidden: Hidden states that the LM head maps to logits.
        lm_head_weight: The LM head (or tied embedding) weight.
        input_ids: The token sequence.
        temperature: Sampling temperature, > 0.
        chunk_size: Tokens (over B x T) per chunk.
        mask: The tokens to compute (e.g. the response tokens); the others are 0 and cost no
            LM-head work. None computes every token.

    Returns:
        Per-token log-probs, column 0 = 0.
    """
    check_logits_and_ids(hidden, input_ids, "hidden")
    return _chunked(
        _tiled_logprobs, hidden, lm_head_weight, input_ids, temperature, chunk_size, mask
    )


def chunked_entropy_from_hidden(
    hidden: Tensor,  # [B, T, H] final hidden states (after the last norm)
    lm_head_weight: Tensor,  # [V, H]
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: Tensor | None = None,  # [B, T] bool or 0/1 float
) -> Tensor:  # [B, T]
    """`entropy_from_logits(hidden @ lm_head_weight.T, temperature)`, chunked.

    Args:
        hidden: Hidden states that the LM head maps to logits.
        lm_head_weight: The LM head (or tied embedding) weight.
        temperature: Sampling temperature, > 0.
        chunk_size: Tokens (over B x T) per chunk.
        mask: The tokens to compute; the others are 0. None computes every token.

    Returns:
        Per-token entropies in nats, column 0 = 0.
    """
    check_ndim("hidden", hidden, (3,))
    dummy_ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    return _chunked(
        _chunked_entropy, hidden, lm_head_weight, dummy_ids, temperature, chunk_size, mask
    )


def _chunk_jsd(
    student_logits: Tensor,  # [n, V]
    teacher_hidden: Tensor,  # [n, H_T], detached
    teacher_weight: Tensor,  # [V, H_T], detached
    beta: float,
    temperature: float,
    clip: float | None,
    clip_mode: str,
) -> tuple[Tensor, Tensor]:  # [n], [n]
    return generalized_jsd_per_token(
        student_logits,
        teacher_hidden @ teacher_weight.T,  # [n, V]; no grad, so autograd saves nothing of it
        beta=beta,
        temperature=temperature,
        clip=clip,
        clip_mode=clip_mode,
    )


def chunked_generalized_jsd(
    student_hidden: Tensor,  # [N, H] hidden states predicting the supervised tokens
    student_weight: Tensor,  # [V, H] the student's LM head
    teacher_hidden: Tensor,  # [N, H_T] the teacher's hidden states at the same tokens
    teacher_weight: Tensor,  # [V, H_T] the teacher's LM head
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    clip: float | None = None,
    clip_mode: str = "scale",
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:  # [N], [N]
    """The generalised JSD between two LM heads' distributions, in recomputed row chunks.

    Equal, in value and in gradient, to `generalized_jsd_per_token(student_hidden @
    student_weight.T, teacher_hidden @ teacher_weight.T, ...)` (see there for the definition),
    without ever holding more than `chunk_size` rows of `[N, V]` logits.

    Args:
        student_hidden: Student hidden states (with grad), one row per supervised token.
        student_weight: Student LM head (or tied embedding) weight; may require grad.
        teacher_hidden: Teacher hidden states at the same tokens; detached here.
        teacher_weight: Teacher LM head weight; detached here. Its hidden size may differ from
            the student's; its vocabulary may not.
        beta: Interpolation in [0, 1]; 0 = KL(p_T || p_S), 1 = KL(p_S || p_T).
        temperature: Softmax temperature, > 0.
        clip: Cap (> 0), or None for none.
        clip_mode: `"scale"`, `"element"` or `"token"` (see `generalized_jsd_per_token`).
        chunk_size: Rows per chunk.

    Returns:
        `(per_token, clipped_share)` as `generalized_jsd_per_token` returns them; the second
        is detached. Both are float32 for half-precision inputs, and empty (still attached to
        the graph) for N = 0.
    """
    check_jsd_options(beta, temperature, clip, clip_mode)
    _check_chunk_size(chunk_size)
    named = [
        ("student_hidden", student_hidden),
        ("student_weight", student_weight),
        ("teacher_hidden", teacher_hidden),
        ("teacher_weight", teacher_weight),
    ]
    for name, t in named:
        check_ndim(name, t, (2,))
    for (h_name, h), (w_name, w) in (named[:2], named[2:]):
        if w.shape[1] != h.shape[1]:
            raise ValueError(f"{w_name} {shape_str(w)} must be [V, H] for {h_name} {shape_str(h)}")
    if teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(
            f"student_hidden {shape_str(student_hidden)} and teacher_hidden "
            f"{shape_str(teacher_hidden)} must have the same number of tokens"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"student_weight {shape_str(student_weight)} and teacher_weight "
            f"{shape_str(teacher_weight)} must have the same vocabulary size"
        )
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    return lm_head_in_chunks(
        _chunk_jsd,
        student_hidden,
        student_weight,
        (teacher_hidden,),
        (teacher_weight, beta, temperature, clip, clip_mode),
        chunk_size,
    )

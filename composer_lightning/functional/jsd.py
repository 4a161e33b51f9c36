"""Generalised Jensen-Shannon divergence between student and teacher token distributions.

Follows the GKD convention (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", https://arxiv.org/abs/2306.13649) as implemented by
TRL's `GKDTrainer.generalized_jsd_loss`: beta = 0 is KL(teacher || student), beta = 1 is
KL(student || teacher), and the interior uses the mixture M = beta*p_T + (1-beta)*p_S. The end
points are deliberately discontinuous with the interior (the interior tends to 0, not to a KL,
as beta -> 0 or 1). Logits may be -inf (a masked vocabulary): such an entry gets probability
exactly 0 and contributes exactly 0 to the value and the gradient, unless the divergence is truly
infinite there (student at -inf where the teacher has mass at beta = 0, or the converse at
beta = 1), where the value is huge but finite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import (
    as_bool_mask,
    check_choice,
    check_ndim,
    check_range,
    check_same_shape,
    shape_str,
)
from .logprobs import scaled_logits, upcast

CLIP_MODES = ("scale", "element", "token")


def check_jsd_options(beta: float, temperature: float, clip: float | None, clip_mode: str) -> None:
    """Validate the scalar options of `generalized_jsd_per_token` (shared with `chunked.py`)."""
    check_range("beta", beta, 0.0, 1.0, low_closed=True, high_closed=True)
    check_range("temperature", temperature, 0.0)
    if clip is not None:
        check_range("clip", clip, 0.0)
    check_choice("clip_mode", clip_mode, CLIP_MODES)


def generalized_jsd_per_token(
    student_logits: Tensor,  # [B, T, V] or [N, V]
    teacher_logits: Tensor,  # [B, T, V] or [N, V]
    mask: Tensor | None = None,  # [B, T] or [N], bool or 0/1 float; None = all tokens
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    clip: float | None = None,
    clip_mode: str = "scale",
) -> tuple[Tensor, Tensor]:  # [B, T], [B, T]
    """Per-token generalised JSD and the share of it that the clip removed.

    With `p_S = softmax(student_logits / temperature)`, `p_T = softmax(teacher_logits /
    temperature)` (no temperature^2 factor), each vocabulary entry contributes
    `p(v) * (log p(v) - log q(v))` to a KL, computed in log space; log M is a log-sum-exp.

    Clip modes (each bounds a token's value at `clip`; they differ in the gradient):
    - `"scale"` (default): the token's divergence `D` times `min(1, clip / D)`, the factor
      detached. The value is `min(D, clip)`; the gradient is `min(1, clip / D) * grad D`: its
      direction is the divergence's own and its size is bounded (per-token gradient clipping),
      and it is never zero while the distributions differ.
    - `"element"`: caps each vocabulary entry's (beta-weighted) term at `clip` before the sum
      over V (the OPSD code's `jsd_token_clip`). The entries over the cap are those
      with much probability and a large log-ratio: the teacher's confident answer the student
      lacks and the student's confident wrong guess. Their gradient is exactly 0, so the clip
      silences the tokens where the hint matters most (measured: `docs/benchmarks/ablation.md`).
    - `"token"`: caps the per-token sum; a token over the cap passes no gradient at all.

    Args:
        student_logits: Student logits (with grad).
        teacher_logits: Teacher logits (callers detach them).
        mask: Tokens to compute; others are exactly 0 and their logits (even NaN) reach
            neither value nor gradient.
        beta: Interpolation in [0, 1]; 0 = KL(p_T || p_S), 1 = KL(p_S || p_T).
        temperature: Softmax temperature, > 0.
        clip: Bound (> 0), or None for none.
        clip_mode: `"scale"`, `"element"` or `"token"`.

    Returns:
        `(per_token, clipped_share)`: the divergence per token, and per token the share of its
        unclipped divergence that the clip removed, `(unclipped − clipped) / unclipped`
        (detached; 0 without a clip) — the figure to tune `clip` by; both 0 off the mask.
        Half-precision logits are computed in float32.
    """
    check_jsd_options(beta, temperature, clip, clip_mode)
    check_ndim("student_logits", student_logits, (2, 3))
    check_same_shape(("student_logits", student_logits), ("teacher_logits", teacher_logits))
    s, t = upcast(student_logits), upcast(teacher_logits)
    m = None
    if mask is not None:
        if mask.shape != s.shape[:-1]:
            raise ValueError(
                f"mask {shape_str(mask)} must match student_logits {shape_str(s)} "
                "without its vocabulary dimension"
            )
        m = as_bool_mask(mask)
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        s = torch.where(m[..., None], s, zero)
        t = torch.where(m[..., None], t, zero)

    log_ps = torch.log_softmax(scaled_logits(s, temperature), dim=-1)  # [..., V]
    log_pt = torch.log_softmax(scaled_logits(t, temperature), dim=-1)  # [..., V]
    if beta == 0.0:
        terms = log_pt.exp() * (log_pt - log_ps)
    elif beta == 1.0:
        terms = log_ps.exp() * (log_ps - log_pt)
    else:
        # log M = logsumexp([log beta + log p_T, log(1 - beta) + log p_S]); logaddexp is the
        # two-term logsumexp without materialising the stack.
        log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
        terms = beta * log_pt.exp() * (log_pt - log_m) + (1.0 - beta) * log_ps.exp() * (
            log_ps - log_m
        )

    unclipped = terms.sum(dim=-1)
    if clip is not None and clip_mode == "scale":
        factor = (clip / unclipped.detach().clamp(min=torch.finfo(s.dtype).tiny)).clamp(max=1.0)
        per_token = unclipped * factor
    elif clip is not None and clip_mode == "element":
        per_token = terms.clamp(max=clip).sum(dim=-1)
    elif clip is not None:
        per_token = unclipped.clamp(max=clip)
    else:
        per_token = unclipped
    with torch.no_grad():  # what the clip removed, as a share of the token's divergence
        removed = unclipped - per_token
        share = torch.where(
            unclipped > 0,
            removed / unclipped.clamp(min=torch.finfo(s.dtype).tiny),
            torch.zeros_like(removed),
        )
    if m is not None:
        per_token = torch.where(m, per_token, torch.zeros_like(per_token))
        share = torch.where(m, share, torch.zeros_like(share))
    return per_token, share


def generalized_jsd(
    student_logits: Tensor,  # [B, T, V] or [N, V]
    teacher_logits: Tensor,  # [B, T, V] or [N, V]
    mask: Tensor | None = None,  # [B, T] or [N], bool or 0/1 float; None = all tokens
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    clip: float | None = None,
    clip_mode: str = "scale",
) -> Tensor:  # []
    """Generalised JSD averaged over the masked tokens (0, attached to the graph, if none).

    See `generalized_jsd_per_token` for the definition and arguments; this is TRL's
    `generalized_jsd_loss` with the mean taken over masked tokens only.
    """
    per_token, _ = generalized_jsd_per_token(
        student_logits,
        teacher_logits,
        mask,
        beta=beta,
        temperature=temperature,
        clip=clip,
        clip_mode=clip_mode,
    )
    count = max(per_token.numel(), 1) if mask is None else as_bool_mask(mask).sum().clamp(min=1)
    return per_token.sum() / count

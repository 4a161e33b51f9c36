"""Aligning a teacher forward (hinted context) with the student's response tokens.

Teacher and student are aligned by response-token index through `teacher_positions`, never by
padding: for a student token t with `p = teacher_positions[b, t] >= 0` the teacher predicts the
same token at teacher position p, i.e. from its logits at p - 1.
"""

from __future__ import annotations

import torch
from torch import Tensor


def teacher_alignment(
    input_ids: Tensor,  # [B, T]
    teacher_input_ids: Tensor,  # [B, T']
    teacher_positions: Tensor,  # [B, T] long, -1 where unmapped
    required_mask: Tensor,  # [B, T] bool, tokens that must be mapped
) -> Tensor:
    """Per sample: every required token is mapped to a teacher position p ≥ 1 holding the same id.

    Returns:
        `[B]` bool, True where the sample is aligned.
    """
    if teacher_positions.shape != input_ids.shape:
        raise ValueError(
            f"teacher_positions {list(teacher_positions.shape)} and input_ids "
            f"{list(input_ids.shape)} must have the same shape"
        )
    required = required_mask.bool()
    mapped = teacher_positions >= 0
    in_range = mapped & (teacher_positions >= 1) & (teacher_positions < teacher_input_ids.shape[1])
    safe = teacher_positions.clamp(0, teacher_input_ids.shape[1] - 1)
    same = torch.gather(teacher_input_ids, 1, safe) == input_ids
    bad = (mapped & ~(in_range & same)) | (required & ~mapped)
    return ~bad.any(dim=1)


def gather_teacher_logits(
    teacher_logits: Tensor,  # [B, T', V] logits of the teacher forward (position p predicts p + 1)
    teacher_positions: Tensor,  # [B, T] long, -1 where unmapped
) -> Tensor:
    """The teacher logits that predict each student token, in the student layout.

    Returns:
        `[B, T, V]`: row t holds teacher_logits[p - 1] for p = teacher_positions[t]; zeros where
        unmapped.
    """
    B, T = teacher_positions.shape
    V = teacher_logits.shape[-1]
    src = (teacher_positions - 1).clamp(min=0)  # [B, T]
    out = torch.gather(teacher_logits, 1, src.unsqueeze(-1).expand(B, T, V))
    return torch.where((teacher_positions >= 1).unsqueeze(-1), out, torch.zeros_like(out))

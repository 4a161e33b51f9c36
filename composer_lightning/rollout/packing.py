"""Packing tokenised samples (single-turn rollouts or multi-turn traces) into a `RolloutBatch`."""

from __future__ import annotations

from typing import Any

import torch

from composer_lightning.chat import TraceSample
from composer_lightning.protocols.batch import RolloutBatch, pad_rows


def pack_samples(
    samples: list[TraceSample],
    *,
    rewards: list[float | None],
    group_ids: list[int],
    pad_id: int,
    max_response_length: int,
    engine_logprobs: list[list[float]] | None = None,
) -> RolloutBatch:
    """Right-padded `RolloutBatch`: `has_reward` where a reward is given, `has_teacher` where the
    sample has a hinted teacher context. A sample without one gets a single attended pad token
    as its teacher row, so the shared teacher forward never sees a fully masked row."""
    T = max(len(s.student_ids) for s in samples)
    teacher_rows = [s.teacher_ids if s.teacher_ids is not None else [pad_id] for s in samples]
    return RolloutBatch(
        **_candidates(samples, teacher_rows, pad_id, T),
        input_ids=pad_rows([s.student_ids for s in samples], pad_id),
        attention_mask=pad_rows([[1] * len(s.student_ids) for s in samples]),
        response_mask=pad_rows([s.response_mask for s in samples], False, torch.bool),
        rewards=torch.tensor([r or 0.0 for r in rewards], dtype=torch.float),
        has_reward=torch.tensor([r is not None for r in rewards]),
        group_ids=torch.tensor(group_ids),
        max_response_length=max_response_length,
        engine_logprobs=None
        if engine_logprobs is None
        else pad_rows(engine_logprobs, 0.0, torch.float),
        has_teacher=torch.tensor([s.has_teacher for s in samples]),
        teacher_input_ids=pad_rows(teacher_rows, pad_id),
        teacher_attention_mask=pad_rows([[1] * len(r) for r in teacher_rows]),
        teacher_positions=pad_rows([s.teacher_positions for s in samples], -1, width=T),
        sdpo_mask=pad_rows([s.sdpo_mask for s in samples], False, torch.bool),
    )


def _candidates(
    samples: list[TraceSample], teacher_rows: list[list[int]], pad_id: int, T: int
) -> dict[str, Any]:  # (tensors: Any, to go into RolloutBatch(**...))
    """The candidate fields (`[B, C, ...]`) when some sample has candidates, else none; a
    missing candidate repeats the sample's teacher row (never a fully masked row)."""
    C = max(len(s.candidates) for s in samples)
    if C == 0:
        return {}
    rows, positions = [], []
    for s, fallback in zip(samples, teacher_rows, strict=True):
        for c in range(C):
            ids, pos = s.candidates[c] if c < len(s.candidates) else (fallback, [-1] * T)
            rows.append(ids)
            positions.append(pos)
    padded = pad_rows(rows, pad_id)
    B = len(samples)
    return {
        "candidate_input_ids": padded.view(B, C, -1),
        "candidate_attention_mask": pad_rows([[1] * len(r) for r in rows]).view(B, C, -1),
        "candidate_positions": pad_rows(positions, -1, width=T).view(B, C, T),
        "has_candidate": torch.tensor([[c < len(s.candidates) for c in range(C)] for s in samples]),
    }

"""Top-k OPD with overlap-guided hint selection (OpenClaw-RL's current OPD).

Sampled-token OPD scores only the token the student drew; when the right token is far down the
student's distribution it is never drawn, and OPD can only push the wrong ones down. Top-k OPD
applies the teacher's log-ratio to a k-token subset of the vocabulary per position (the
student's top-k, the teacher's or their overlap), so the teacher can raise a token the student
did not sample. Each sample may carry several candidate hints (`VerifierHint(candidates=…)`, a
judge's accepted hints); one teacher forward per candidate, and the candidate whose teacher
agrees most with the student (largest top-k overlap, per sequence or per token) or the shortest
one supplies the teacher. The formulas are in `functional/topk_opd.py`.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

from composer_lightning.functional.topk_opd import (
    SELECTIONS,
    SUBSETS,
    candidate_overlap,
    chunked_logprobs_at,
    select_candidates,
    topk_opd_per_token,
)
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext


class TopKOPDHead(Head):
    """Top-k OPD loss on the response tokens of samples with a candidate hint.

    Args:
        weight, name, schedule: as every head's.
        k: the top-k size (OpenClaw-RL: 4).
        subset: `student` (top-k of the policy that sampled), `teacher` (top-k of the selected
            teacher) or `overlap` (their intersection).
        selection: `sequence_optimal` (the candidate with the largest top-k overlap over the
            sequence), `token_optimal` (per token) or `shortest` (the shortest hint).
        gap_clip: clamp of `teacher − old` per vocabulary entry (OpenClaw-RL: 1.0); None: none.
        clip_low, clip_high: the PPO clip of each entry's ratio.
    """

    default_name = "topk_opd"
    requires = frozenset({"hidden", "teacher_topk"})

    def __init__(
        self,
        weight: float = 1.0,
        k: int = 4,
        subset: Literal["student", "teacher", "overlap"] = "student",
        selection: Literal["sequence_optimal", "token_optimal", "shortest"] = "sequence_optimal",
        gap_clip: float | None = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{self.name}: k must be an integer >= 1, got {k!r}")
        if subset not in SUBSETS:
            raise ValueError(f"{self.name}: subset must be one of {SUBSETS}, got {subset!r}")
        if selection not in SELECTIONS:
            raise ValueError(
                f"{self.name}: selection must be one of {SELECTIONS}, got {selection!r}"
            )
        if gap_clip is not None and not gap_clip > 0:
            raise ValueError(f"{self.name}: gap_clip must be > 0 or None, got {gap_clip}")
        if not 0 < clip_low < 1 or not clip_high > 0:
            raise ValueError(
                f"{self.name}: need 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}"
            )
        self.topk, self.subset, self.selection = k, subset, selection
        self.gap_clip, self.clip_low, self.clip_high = gap_clip, clip_low, clip_high

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        tk = ctx.teacher_topk
        B, C, T, K = tk.teacher_ids.shape
        if C == 0 or batch.has_candidate is None:
            zero = ctx.hidden.sum() * 0.0
            return HeadOutput(loss=zero, metrics={"tokens": 0.0, "candidates": 0.0})
        available = batch.has_candidate & tk.aligned  # [B, C]
        misaligned = (batch.has_candidate & ~tk.aligned).any(dim=1)
        if misaligned.any():
            warnings.warn(
                f"{self.name}: {int(misaligned.sum())} sample(s) have candidate teacher "
                "positions that do not align with the response; those candidates are skipped",
                stacklevel=2,
            )
        tokens = batch.response_mask & available.any(dim=1, keepdim=True)  # [B, T]
        overlap = candidate_overlap(tk.old_ids, tk.teacher_ids.transpose(1, 2)).transpose(1, 2)
        chosen = select_candidates(overlap, available, tokens, self.selection)  # [B, T]

        def pick(x: torch.Tensor) -> torch.Tensor:  # [B, C, T, K] -> [B, T, K]
            return x.gather(1, chosen[:, None, :, None].expand(B, 1, T, K)).squeeze(1)

        if self.subset == "teacher":
            ids, old, teacher = (
                pick(tk.teacher_ids),
                pick(tk.old_at_teacher),
                pick(tk.teacher_logprobs),
            )
            in_subset = torch.ones_like(ids, dtype=torch.bool)
        else:
            ids, old, teacher = tk.old_ids, tk.old_logprobs, pick(tk.teacher_at_old)
            if self.subset == "overlap":
                same = tk.old_ids[..., :, None] == pick(tk.teacher_ids)[..., None, :]
                in_subset = same.any(dim=-1)
            else:
                in_subset = torch.ones_like(ids, dtype=torch.bool)
        current = chunked_logprobs_at(
            ctx.hidden[tokens], ctx.lm_head_weight, ids[tokens], ctx.temperature, ctx.chunk_size
        )  # [N, K]
        per_token, surrogate_metrics = topk_opd_per_token(
            current,
            old[tokens],
            teacher[tokens],
            in_subset[tokens],
            gap_clip=self.gap_clip,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
        )
        metrics: dict[str, Tensor | float] = {**surrogate_metrics}
        values = torch.zeros(B, T, dtype=per_token.dtype, device=per_token.device)
        values = values.masked_scatter(tokens, per_token)
        mask = tokens.clone()
        mask[tokens] = in_subset[tokens].any(dim=-1)  # an empty overlap has no term
        n = float(mask.sum())
        with torch.no_grad():
            chosen_overlap = overlap.gather(1, chosen[:, None, :]).squeeze(1)
            metrics["overlap"] = chosen_overlap[mask].float().mean() if n else 0.0
            has = available.any(dim=1)
            metrics["candidates"] = available.sum(dim=1)[has].float().mean() if has.any() else 0.0
        return HeadOutput(
            loss=ctx.aggregate(values, mask),
            metrics={**metrics, "tokens": n},
        )

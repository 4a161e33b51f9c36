"""OPD teacher advantage (OpenClaw-RL "combine"): `A_t = teacher_logprobs_t − old_logprobs_t`.

The teacher is the live policy (no grad) on the hinted context by default, or a separate
frozen teacher model; either way the module runs ONE teacher forward shared with SDPO.
"""

from __future__ import annotations

import warnings
from typing import Literal

from composer_lightning.functional import opd_advantages
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext


class OPDHead(Head):
    """Per-token teacher advantage on samples with an accepted hint; exactly 0 elsewhere.

    Samples whose teacher positions do not map onto the same tokens are left out (0) with a
    warning, never computed on misaligned tokens.

    Args:
        weight, name, schedule: as every head's.
        gap_clip: clamp `teacher − old` to `[-gap_clip, gap_clip]` (OpenClaw-RL's top-k OPD uses
            1.0); None (default): the plain gap, as OpenClaw-RL's combine.
        center: "sequence" (default): subtract each reply's mean gap, so a hint that moves the
            whole reply alike pushes none of it (`functional.opd_advantages`): the plain gap
            averages −KL(student ‖ teacher) < 0 on the student's own tokens, and uncentred it
            pushes every sampled reply down (on SmolLM2 −0.17 to −0.27 a token, on every reply;
            docs/benchmarks/smollm2.md); None: the plain gap, as OpenClaw-RL's combine.
    """

    default_name = "opd"
    requires = frozenset({"teacher_logprobs"})
    per_token_advantages = True

    def __init__(
        self,
        weight: float = 1.0,
        gap_clip: float | None = None,
        center: Literal["sequence"] | None = "sequence",
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        if gap_clip is not None and not gap_clip > 0:
            raise ValueError(f"{self.name}: gap_clip must be > 0 or None, got {gap_clip}")
        if center not in (None, "sequence"):
            raise ValueError(f"{self.name}: center must be None or 'sequence', got {center!r}")
        self.gap_clip, self.center = gap_clip, center

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        assert batch.has_teacher is not None  # RolloutBatch.__post_init__ fills it
        aligned = ctx.teacher_aligned  # [B]
        misaligned = batch.has_teacher & ~aligned
        if misaligned.any():
            warnings.warn(
                f"{self.name}: {int(misaligned.sum())} sample(s) with misaligned teacher "
                "positions get no OPD term",
                stacklevel=2,
            )
        active = batch.response_mask & (batch.has_teacher & aligned).unsqueeze(1)  # [B, T]
        advantages = opd_advantages(
            ctx.teacher_logprobs,
            ctx.old_logprobs,
            active,
            gap_clip=self.gap_clip,
            center=self.center,
        )
        return HeadOutput(
            advantages=advantages.detach(),
            active_mask=active,
            metrics={
                "teacher_frac": batch.has_teacher.float().mean(),
                "misaligned": float(misaligned.sum()),
            },
        )

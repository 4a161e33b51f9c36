"""SDPO: generalised-JSD self-distillation against the same model given a hint.

The student (grad) and the teacher (no grad; the policy on the hinted context, or a frozen
teacher model) are compared over the full vocabulary at `sdpo_mask` positions (GKD convention,
Agarwal et al. 2024; TRL `generalized_jsd_loss`). An optional bound scales a token's divergence
down to `clip` (its gradient keeps its direction); the OPSD code's element-wise clamp is
still there as `clip_mode="element"`, but it zeroes the gradient exactly where teacher
and student confidently disagree (`functional.jsd.generalized_jsd_per_token`).
"""

from __future__ import annotations

import warnings
from typing import Literal

from composer_lightning.functional.chunked import chunked_generalized_jsd
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import LinearWarmup, Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext


class SDPOHead(Head):
    """Generalised JSD between student and hinted-teacher logits, mean over masked tokens.

    Samples whose teacher positions do not map onto the same tokens are left out (with a
    warning), never computed on misaligned tokens.

    Args:
        beta: JSD interpolation in [0, 1] (0: KL(teacher‖student), 1: KL(student‖teacher)).
        temperature: τ > 0 applied to both logits inside the divergence.
        clip: bound (> 0) on a token's divergence; None (default) disables it.
        clip_mode: `scale` (default: a token's divergence times `min(1, clip / D)`, detached;
            the gradient keeps its direction), `element` (cap each vocabulary entry's term, as
            the OPSD code: zero gradient on the capped entries) or `token` (cap the sum: zero
            gradient on a capped token).
        warmup_steps: linear warm-up of the weight (ignored when `schedule` is given).
        weight, name, schedule: as `Head`'s.
    """

    default_name = "sdpo"
    requires = frozenset({"hidden", "teacher_hidden"})

    def __init__(
        self,
        weight: float = 1.0,
        beta: float = 0.5,
        temperature: float = 1.0,
        clip: float | None = None,
        clip_mode: Literal["scale", "element", "token"] = "scale",
        warmup_steps: int = 0,
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        if schedule is None and warmup_steps:
            schedule = LinearWarmup(warmup_steps)
        super().__init__(name=name, weight=weight, schedule=schedule)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"{self.name}: beta must be in [0, 1], got {beta}")
        if not temperature > 0:
            raise ValueError(f"{self.name}: temperature must be > 0, got {temperature}")
        if clip is not None and not clip > 0:
            raise ValueError(f"{self.name}: clip must be > 0 or None, got {clip}")
        if clip_mode not in ("scale", "element", "token"):
            raise ValueError(
                f"{self.name}: clip_mode must be 'scale', 'element' or 'token', got {clip_mode!r}"
            )
        self.beta, self.temperature, self.clip, self.clip_mode = beta, temperature, clip, clip_mode

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        assert batch.sdpo_mask is not None and batch.has_teacher is not None  # __post_init__
        supervised = batch.sdpo_mask & batch.has_teacher.unsqueeze(1)  # [B, T]
        misaligned = supervised.any(dim=1) & ~ctx.teacher_aligned  # [B]
        if misaligned.any():
            warnings.warn(
                f"{self.name}: teacher positions do not align with the student's response "
                f"tokens in {int(misaligned.sum())} sample(s); their SDPO term is skipped",
                stacklevel=2,
            )
        mask = supervised & ~misaligned.unsqueeze(1)  # [B, T]
        # Only the supervised tokens' hidden states enter the divergence, [N, H]; the LM head
        # is applied to them in chunks, so no [N, V] logits outlive one chunk.
        per_token, clipped = chunked_generalized_jsd(
            ctx.hidden[mask],
            ctx.lm_head_weight,
            ctx.teacher_hidden[mask],
            ctx.teacher_lm_head_weight,
            beta=self.beta,
            temperature=self.temperature,
            clip=self.clip,
            clip_mode=self.clip_mode,
            chunk_size=ctx.chunk_size,
        )  # [N] each
        n = int(mask.sum())
        loss = per_token.sum() / max(n, 1)  # 0, still attached to the graph, when n = 0
        jsd = per_token.new_zeros(mask.shape)  # [B, T], each supervised token's divergence
        jsd[mask] = per_token.detach()
        return HeadOutput(
            loss=loss,
            metrics={
                "jsd": loss.detach(),
                "clipped_share": clipped.float().mean() if n else 0.0,
                "tokens": float(n),
                "misaligned": float(misaligned.sum()),
            },
            token_metrics={"jsd": jsd},
        )

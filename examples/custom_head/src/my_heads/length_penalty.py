"""A plug-in advantage head: penalise long responses.

`A_t = −coef · (response length of the sample) / max_response_length` on response tokens. It
is mixed into the same clipped surrogate as the built-in advantage heads.
"""

from __future__ import annotations

from composer_lightning.heads import Head, HeadOutput, Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext


class LengthPenaltyHead(Head):
    """Advantage term −coef · length / max_response_length on every response token."""

    default_name = "length_penalty"

    def __init__(
        self,
        coef: float = 0.1,
        weight: float = 1.0,
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        self.coef = coef

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        length = batch.response_mask.sum(1, keepdim=True).to(ctx.logprobs.dtype)  # [B, 1]
        adv = -self.coef * length / batch.max_response_length * batch.response_mask
        return HeadOutput(advantages=adv, metrics={"length_mean": length.mean()})

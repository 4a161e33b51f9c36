"""Supervised fine-tuning on the batch's own good samples: the negative log-likelihood of the
response tokens of every row whose reward is at least `min_reward`.

On demonstration traces (`TraceDataModule` rows with `reward: 1.0`) it is plain SFT, as TRL's
`SFTTrainer` computes it on assistant tokens (`assistant_only_loss`): a way to show a model a
behaviour (a tool-call syntax) before RL can reinforce it. On sampled rollouts it is rejection
sampling fine-tuning (RAFT, Dong et al. 2023, https://arxiv.org/abs/2304.06767): the NLL of the
replies the verifier accepted. The loss is reduced with the module's aggregation over the
accepted rows' response tokens, so micro-batches sum to the unbatched step.
"""

from __future__ import annotations

import math

from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext


class SFTHead(Head):
    """Supervised fine-tuning: the NLL of the response tokens of rows rewarded ≥ `min_reward`.

    `weight · aggregate(−log π_θ(y_t | y_<t, x))` over the response tokens of the rows with a
    reward ≥ `min_reward` (rows without a reward never count).

    Args:
        min_reward: the least reward a row needs to be imitated (1.0: only fully right rows
            and demonstrations; 0.0: every rewarded row, i.e. plain SFT on all of them).
        weight, name, schedule: as `Head`'s.
    """

    default_name = "sft"

    def __init__(
        self,
        weight: float = 1.0,
        min_reward: float = 1.0,
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        if (
            isinstance(min_reward, bool)
            or not isinstance(min_reward, (int, float))
            or not math.isfinite(min_reward)
        ):
            raise ValueError(f"{self.name}: min_reward must be a finite number, got {min_reward!r}")
        self.min_reward = float(min_reward)

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        accepted = batch.has_reward & (batch.rewards >= self.min_reward)  # [B]
        mask = batch.response_mask & accepted.unsqueeze(1)  # [B, T]
        nll = -ctx.logprobs  # [B, T], with grad
        n = mask.sum()
        return HeadOutput(
            loss=ctx.aggregate(nll, mask),
            metrics={
                "nll": (nll.detach() * mask).sum() / n.clamp(min=1),
                "accepted_frac": accepted.float().mean(),
                "tokens": n.float(),
            },
        )

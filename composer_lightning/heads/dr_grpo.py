"""Dr. GRPO: group-baseline advantages without std division (Liu et al. 2025,
"Understanding R1-Zero-Like Training", https://arxiv.org/abs/2503.20783)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from composer_lightning.functional import episode_advantages, gdpo_advantages, grpo_advantages
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class DrGRPOHead(Head):
    """`A_i = R_i − mean(rewarded R in group)`, broadcast over response tokens; 0 without reward.
    Of an episode whose turns are rows (`episode_ids`), the episode's advantage on every turn.

    Args:
        scale_rewards: "none" (Dr. GRPO, default); "group" divides by the group's reward
            standard deviation + 1e-4 (GRPO, TRL's default) and "batch" by the rollout
            batch's (`functional.grpo_advantages`), for comparison with TRL's `scale_rewards`.
        multi_objective_aggregation: "sum_then_normalize" (default): the advantage of the
            summed, weighted reward; "normalize_then_sum": GDPO (TRL's option of that name,
            `functional.gdpo_advantages`), each reward function normalised within the group
            before the weighted sum, the sum normalised over the batch (`scale_rewards` is then
            not used); it needs each function's values, which `FunctionScore` with several
            functions gives.
        weight, name, schedule: as `Head`'s.
    """

    default_name = "dr_grpo"

    def __init__(
        self,
        weight: float = 1.0,
        scale_rewards: Literal["none", "group", "batch"] = "none",
        name: str | None = None,
        schedule: Schedule | None = None,
        multi_objective_aggregation: Literal[
            "sum_then_normalize", "normalize_then_sum"
        ] = "sum_then_normalize",
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        if scale_rewards not in ("none", "group", "batch"):
            raise ValueError(
                f"{self.name}: scale_rewards must be 'none', 'group' or 'batch', got "
                f"{scale_rewards!r}"
            )
        self.scale_rewards = scale_rewards
        if multi_objective_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"{self.name}: multi_objective_aggregation must be one of {AGGREGATIONS}, got "
                f"{multi_objective_aggregation!r}"
            )
        self.gdpo = multi_objective_aggregation == "normalize_then_sum"

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        # the statistics of "batch" options are the rollout batch's, however many minibatches
        adv = ctx.over_rollout(batch, lambda whole: self.advantages(whole, ctx.logprobs.dtype))
        active = batch.response_mask & batch.has_reward.unsqueeze(1)  # [B, T]
        advantages = adv.unsqueeze(1) * active
        return HeadOutput(
            advantages=advantages.detach(),
            active_mask=active,
            metrics={
                "reward_mean": batch.rewards[batch.has_reward].float().mean()
                if batch.has_reward.any()
                else 0.0,
                "rewarded_frac": batch.has_reward.float().mean(),
            },
        )

    def advantages(self, batch: RolloutBatch, dtype: torch.dtype) -> Tensor:
        """`[B]` the per-sample advantages of a whole rollout batch (0 without a reward)."""
        rewards = batch.rewards.to(dtype)
        if self.gdpo:
            if batch.reward_components is None:
                raise ValueError(
                    f"{self.name}: multi_objective_aggregation='normalize_then_sum' normalises "
                    "each reward function's values, and this batch has none: score with a "
                    "FunctionScore of several reward functions"
                )
            weights = torch.tensor(batch.reward_weights, dtype=rewards.dtype)
            return gdpo_advantages(
                batch.reward_components.to(rewards),
                weights,
                batch.group_ids,
                batch.has_reward,
                batch.episode_ids,
            )
        if batch.episode_ids is None:
            return grpo_advantages(rewards, batch.group_ids, batch.has_reward, self.scale_rewards)
        # an episode's turns are rows: the episode counts once in its group
        return episode_advantages(
            rewards, batch.group_ids, batch.episode_ids, batch.has_reward, self.scale_rewards
        )

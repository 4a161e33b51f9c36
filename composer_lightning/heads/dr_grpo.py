"""Dr. GRPO: group-baseline advantages without std division (Liu et al. 2025,
"Understanding R1-Zero-Like Training", https://arxiv.org/abs/2503.20783)."""

from __future__ import annotations

from composer_lightning.batch import RolloutBatch
from composer_lightning.functional import dr_grpo_advantages
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.step import StepContext


class DrGRPOHead(Head):
    """`A_i = R_i − mean(rewarded R in group)`, broadcast over response tokens; 0 without reward."""

    default_name = "dr_grpo"

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        rewards = batch.rewards.to(ctx.logprobs.dtype)
        adv = dr_grpo_advantages(rewards, batch.group_ids, batch.has_reward)  # [B]
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

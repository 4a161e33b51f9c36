"""Context distillation: the student, without the hint, imitates the replies its hinted self
sampled (`rollout.hinted_replies`; Snell et al. 2022, https://arxiv.org/abs/2209.15189).

OPD and SDPO read the hinted teacher at the student's own tokens; this head reads the tokens
the hinted teacher wrote. It is the negative log-likelihood of each hinted reply under the
student's context (the turn as the student saw it), reduced with the module's aggregation over
the replies' tokens, exactly as `SFTHead` reduces the batch's own rows: the rows are all the
hinted replies of the minibatch's groups, and those it does not imitate count as rows without
a token (with `token_sum_norm`, 1 accepted reply of 8 weighs 1/8 of 8 of 8, as SFT on the same
rows; never the head's whole weight on one lucky reply). With `min_reward` only the replies the
verifier accepts are imitated (rejection sampling), with `min_reward: null` every reply (plain
context distillation, and the only choice for a tool call, which has no outcome of its own). A
minibatch imitates the replies of its own groups, so minibatches sum to one step.
"""

from __future__ import annotations

import math

import torch

from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext


class ContextDistillHead(Head):
    """Context distillation: the NLL of the hinted teacher's own replies, without the hint.

    `weight · aggregate(−log π_θ(y_t | y_<t, x))` over the tokens of the hinted replies `y`
    (sampled from the hinted context `x + hint`) that the head imitates, set after the
    student's context `x`.

    Args:
        weight, name, schedule: as `Head`'s.
        min_reward: the least score a hinted reply needs to be imitated (1.0: only right ones);
            None: every reply, scored or not.
    """

    default_name = "context_distill"
    requires = frozenset({"sequence_logprobs", "hinted_replies"})

    def __init__(
        self,
        weight: float = 1.0,
        min_reward: float | None = 1.0,
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        if min_reward is not None and (
            isinstance(min_reward, bool)
            or not isinstance(min_reward, (int, float))
            or not math.isfinite(min_reward)
        ):
            raise ValueError(
                f"{self.name}: min_reward must be a finite number or None (every reply), "
                f"got {min_reward!r}"
            )
        self.min_reward = None if min_reward is None else float(min_reward)

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        rows = batch.hinted
        if rows is None:
            raise ValueError(
                f"{self.name} imitates replies sampled with the hint in context, and this batch "
                "has none: set rollout.hinted_replies (and a rollout.hint)"
            )
        mine = torch.nonzero(torch.isin(rows.group_ids, batch.group_ids)).flatten()  # [N]
        take = torch.ones_like(mine, dtype=torch.bool)
        if self.min_reward is not None:
            take &= rows.has_reward[mine] & (rows.rewards[mine] >= self.min_reward)
        idx = mine[take]
        if len(idx) == 0:
            # the policy forward is a collective under FSDP2: run it on every rank in every
            # step, on a placeholder (the batch's first row) that contributes exactly 0
            keep = batch.attention_mask[0].bool()
            ids, resp = batch.input_ids[:1, keep], batch.response_mask[:1, keep]
            lp = ctx.policy_token_logprobs(ids, torch.ones_like(ids), resp)
            zero = (lp * resp).sum() * 0.0
            return HeadOutput(loss=zero, metrics={"imitated": 0.0, "tokens": 0.0, "nll": 0.0})
        width = int(rows.attention_mask[idx].sum(dim=1).max())
        mask = rows.response_mask[idx, :width]
        lp = ctx.policy_token_logprobs(
            rows.input_ids[idx, :width], rows.attention_mask[idx, :width], mask
        )
        # every reply of the minibatch's groups is a row; those not imitated have no token
        nll = lp.new_zeros(len(mine), width).index_put((torch.nonzero(take).flatten(),), -lp)
        every = torch.zeros_like(nll, dtype=torch.bool)
        every[take] = mask
        n = mask.sum()
        return HeadOutput(
            loss=ctx.aggregate(nll, every),
            metrics={
                "imitated": float(len(idx)),
                "tokens": n.float(),
                "nll": (-lp.detach() * mask).sum() / n.clamp(min=1),
            },
        )

"""Batch statistics are the rollout batch's, however many minibatches train on it.

TRL's `scale_rewards="batch"` divides by the standard deviation of the whole generation batch,
and GDPO's `normalize_then_sum` normalises the weighted sum over it; a rollout batch trained in
2 or 4 minibatches (TRL's `steps_per_generation`) must train on the advantages of the whole
batch, not on each minibatch normalised on its own (issue 50, point 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.training.module import ComposerModule
from tests.helpers import tiny_model
from tests.test_module import Recording, _fit

# 4 groups of 2. Over the whole batch (mean 0.125, unbiased std 0.9910) the advantages are
# ±0.5 / 0.9910 = ±0.5045 (group 0) and ±1 / 0.9910 = ±1.0091 (group 3); groups 1 and 2 tie.
# Normalised per minibatch of two groups they would be ±1 (std 0.5) and ±0.707 (std 1.414):
# group 3 would weigh less than group 0, the other way round.
REWARDS = [1.0, 0.0, 0.0, 0.0, -1.0, -1.0, 2.0, 0.0]


def _batch(rewards: list[float], components: list[list[float]] | None = None):
    batch = synthetic_batch(
        torch.Generator().manual_seed(3), prompts=4, group_size=2, vocab_size=64, reward_prob=1.0
    )
    batch.rewards = torch.tensor(rewards, dtype=torch.float)
    if components is not None:
        batch.reward_components = torch.tensor(components, dtype=torch.float64)
        batch.reward_weights = (1.0, 0.5)
    return batch


def _trained_advantages(batch, head: DrGRPOHead, minibatches: int) -> torch.Tensor:
    """`[B]` each sample's advantage as the updates trained on it (one epoch)."""
    recording = Recording(head)
    module = ComposerModule(
        tiny_model(),
        [recording],
        minibatches=minibatches,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    _fit(module, batch)
    out = torch.zeros(batch.batch_size, dtype=torch.float64)
    for idx, seen in zip(batch.group_splits(minibatches), recording.seen, strict=True):
        adv = seen["adv"]  # [b, T], the sample's advantage on its response tokens
        mask = batch.response_mask[idx]
        out[idx] = (adv * mask).sum(dim=1).double() / mask.sum(dim=1)
    return out


def test_scale_rewards_batch_takes_the_whole_rollout_batchs_std():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    std = float(r.std())  # unbiased, as TRL's
    assert math.isclose(std, 0.99103, abs_tol=1e-5)
    expected = torch.tensor([0.5, -0.5, 0, 0, 0, 0, 1.0, -1.0], dtype=torch.float64) / (std + 1e-4)
    assert math.isclose(float(expected[0]), 0.5045, abs_tol=1e-4)
    for minibatches in (1, 2, 4):
        got = _trained_advantages(_batch(REWARDS), DrGRPOHead(scale_rewards="batch"), minibatches)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"{minibatches}")


def _gdpo_reference(components: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """GDPO by hand (TRL 1.16, `normalize_then_sum`): each function's values centred and
    divided by their std (+1e-4) within the group, the weighted sum normalised over the
    whole batch (unbiased std + 1e-4)."""
    per_group = []
    for g in range(4):
        c = components[2 * g : 2 * g + 2]
        per_group.append((c - c.mean(0)) / (c.std(0) + 1e-4))
    summed = torch.cat(per_group) @ weights
    return (summed - summed.mean()) / (summed.std() + 1e-4)


@pytest.mark.parametrize("minibatches", [1, 2, 4])
def test_gdpo_normalises_the_sum_over_the_whole_rollout_batch(minibatches):
    components = [[1, 0], [0, 1], [1, 1], [0, 1], [0, 0], [1, 0], [1, 1], [0, 0]]
    c = torch.tensor(components, dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    rewards = (c @ weights).tolist()
    expected = _gdpo_reference(c, weights)
    head = DrGRPOHead(multi_objective_aggregation="normalize_then_sum")
    got = _trained_advantages(_batch(rewards, components), head, minibatches)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

"""GDPO (`DrGRPOHead(multi_objective_aggregation="normalize_then_sum")`) through a run: the
rollout carries each reward function's own value per sample from `FunctionScore`, and the head's
advantages are `functional.gdpo_advantages` of them (checked against TRL there)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.functional import gdpo_advantages
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.protocols.step import StepContext
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.tasks import FunctionScore
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer

POLICY = tiny_policy_path()


def length_reward(problem, completion):
    return len(completion) / 10


def digit_reward(problem, completion):
    return None if not completion else float(any(c.isdigit() for c in completion))


class Batches(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append(batch.rollout)


def _context(dtype: torch.dtype) -> StepContext:
    """A step context of a whole rollout batch, for the head's advantages alone."""
    zeros = torch.zeros(1, dtype=dtype)
    return StepContext(0, zeros, zeros, "token_mean", None, 1.0)


def test_each_functions_values_reach_the_head_and_it_normalises_them_apart():
    score = FunctionScore([length_reward, digit_reward], reward_weights=[1.0, 0.5])
    engine = HFEngine(model_path=POLICY, seed=0)
    cb = RolloutCallback(
        engine, group_size=4, sampling=SamplingConfig(max_tokens=8, seed=0), score=score
    )
    head = DrGRPOHead(multi_objective_aggregation="normalize_then_sum")
    batches = Batches()
    module = ComposerModule(POLICY, [head])
    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=3, val_prompts=0)
    quiet_trainer(max_steps=2, callbacks=[cb, batches]).fit(module, dm)
    for rb in batches.seen:
        assert rb.reward_weights == (1.0, 0.5)
        assert rb.reward_components.shape == (rb.batch_size, 2)
        # the combined reward is the weighted sum of the components
        summed = rb.reward_components.nan_to_num(0) @ torch.tensor([1.0, 0.5], dtype=torch.float64)
        torch.testing.assert_close(
            rb.rewards.double()[rb.has_reward], summed[rb.has_reward], rtol=0, atol=1e-6
        )
        out = head.compute(rb, _context(torch.float64))
        want = gdpo_advantages(
            rb.reward_components,
            torch.tensor([1.0, 0.5], dtype=torch.float64),
            rb.group_ids,
            rb.has_reward,
            rb.episode_ids,
        )
        active = rb.response_mask & rb.has_reward[:, None]
        torch.testing.assert_close(out.advantages, want[:, None] * active, rtol=0, atol=1e-12)
    assert any(float(rb.reward_components[:, 0].std()) > 0 for rb in batches.seen)


def test_gdpo_without_each_functions_values_is_one_line():
    batch = synthetic_batch(torch.Generator().manual_seed(0), vocab_size=64)
    head = DrGRPOHead(multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="this batch has none: score with a FunctionScore"):
        head.compute(batch, _context(torch.float32))
    with pytest.raises(
        ValueError, match="must be one of \\('sum_then_normalize', 'normalize_then_sum'\\)"
    ):
        DrGRPOHead(multi_objective_aggregation="gdpo")

"""Reward functions as TRL users write them: the batched signature, several functions with
`reward_weights`, None as "no score" (`tasks/rewards.py`)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from composer_lightning.rollout.providers import provider_values
from composer_lightning.tasks import FunctionScore
from composer_lightning.tasks.rewards import (
    TrainerState,
    takes_batches,
    trl_inputs,
    weighted_rewards,
)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def trl_combined(per_func: list[list[float | None]], weights: list[float]) -> list[float]:
    """TRL 1.16's definition (`GRPOTrainer._calculate_rewards` + `_generate_and_score_
    completions`): None → nan, `(rewards_per_func * reward_weights).nansum(dim=1)`, and a row
    where every function gave nan is unscorable (nan)."""
    r = torch.tensor([[math.nan if v is None else v for v in col] for col in per_func]).T
    out = (r * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    out[torch.isnan(r).all(dim=1)] = math.nan
    return out.tolist()


def test_two_functions_with_weights_skip_none_as_trl_does(caplog):
    """f (batched) gives [1, None, 0.5, None, 3], g (per sample) [0, 2, None, None, -1];
    weights (2, 0.5): 2·1 + 0.5·0 = 2; 0.5·2 = 1; 2·0.5 = 1; no score; 2·3 + 0.5·(−1) = 5.5."""
    f_values = [1.0, None, 0.5, None, 3.0]
    g_values = [0.0, 2.0, None, None, -1.0]

    def f(prompts, completions, **kwargs):
        return [f_values[int(c)] for c in completions]

    def g(problem, completion):
        return g_values[int(completion)]

    scorer = FunctionScore([f, g], reward_weights=[2.0, 0.5])
    assert scorer.batched == [True, False]
    with caplog.at_level("WARNING"):
        out = scorer.score([{"prompt": "p"}] * 5, ["0", "1", "2", "3", "4"])
    assert out == [2.0, 1.0, 1.0, None, 5.5]
    assert scorer.failures == 0  # None is no score, not a failure
    assert _warnings(caplog) == [
        "1 of 5 samples: every reward function returned None (they get no score)"
    ]
    reference = trl_combined([f_values, g_values], [2.0, 0.5])
    assert [None if math.isnan(v) else v for v in reference] == out
    assert weighted_rewards([f_values, g_values], [1.0, 1.0]) == [1.0, 2.0, 0.5, None, 2.0]


def test_none_is_no_score_not_a_failure_through_the_dispatch(caplog):
    scorer = FunctionScore(lambda problem, completion: None if completion == "?" else 1.0)
    with caplog.at_level("WARNING"):
        values, failed = provider_values(scorer, "score", [{}] * 3, ["a", "?", "b"])
    assert values == [1.0, None, 1.0] and failed == 0
    assert not any("sample 1" in m for m in _warnings(caplog))


def test_a_batched_function_receives_what_trl_passes():
    """Standard rows give strings; conversational rows (a chat prompt) give chats and
    completions as `[{"role": "assistant", "content": ...}]`; every other column by name."""
    seen = {}

    def reward(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        kwargs.pop("log_extra")("column", [1, 2])  # TRL's logging hooks: accepted, ignored
        kwargs.pop("log_metric")("name", 1.0)
        seen.update(
            prompts=prompts, completions=completions, ids=completion_ids, answer=answer, **kwargs
        )
        seen["trainer_state"] = trainer_state
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4", "level": 3}]
    assert FunctionScore(reward).score(rows, ["2", "5"], [[7], [8, 9]]) == [1.0, 0.0]
    assert seen == {
        "prompts": ["1+1?", "2+2?"],
        "completions": ["2", "5"],
        "ids": [[7], [8, 9]],
        "answer": ["2", "4"],
        "level": [None, 3],
        "trainer_state": TrainerState(0, 0.0, -1),
    }
    chat = [{"role": "user", "content": "1+1?"}]
    kwargs = trl_inputs([{"prompt": chat, "solution": "2"}], ["2"], None)
    assert kwargs["prompts"] == [chat] and kwargs["solution"] == ["2"]
    assert kwargs["completions"] == [[{"role": "assistant", "content": "2"}]]
    assert kwargs["completion_ids"] is None and "prompt" not in kwargs


def test_the_form_is_told_by_the_signature_or_said_outright():
    assert takes_batches(lambda prompts, completions, **kw: [])
    assert takes_batches(lambda completions, solution, **kw: [])  # open-r1's accuracy_reward
    assert not takes_batches(lambda problem, completion: 0.0)
    assert not takes_batches(lambda *args: 0.0)
    assert not takes_batches(len)  # a builtin: per sample
    batch_of = FunctionScore(lambda *args, **kw: [0.5] * len(kw["completions"]), batched=True)
    assert batch_of.score([{}] * 2, ["a", "b"]) == [0.5, 0.5]


@pytest.mark.parametrize(
    ("returns", "why"),
    [
        (KeyError("solution"), "raised KeyError: 'solution'"),
        ([1.0], "returned 1 values, expected a list of 3 values (one per completion)"),
        (0.5, "returned 0.5, expected a list of 3 values (one per completion)"),
    ],
)
def test_a_broken_batched_call_fails_all_its_samples_with_one_line(returns, why, caplog):
    def reward(prompts, completions, **kwargs):
        if isinstance(returns, Exception):
            raise returns
        return returns

    ok = FunctionScore(lambda completions, **kw: [1.0] * len(completions))
    scorer = FunctionScore([reward, ok.fn])
    with caplog.at_level("WARNING"):
        assert scorer.score([{}] * 3, ["a", "b", "c"]) == [None, None, None]
    assert scorer.failures == 3  # one function failed: the partial sum is not used
    assert _warnings(caplog) == [
        f"reward function reward {why} on a batch of 3 samples (no sample of it gets a score)"
    ]


def test_a_batched_call_has_one_timeout_for_the_batch(caplog):
    release = threading.Event()

    def slow(prompts, completions, **kwargs):
        release.wait(30)
        return [1.0] * len(completions)

    try:
        with caplog.at_level("WARNING"):
            out = FunctionScore(slow, timeout=0.2).score([{}] * 4, ["a"] * 4)
    finally:
        release.set()
    assert out == [None] * 4
    assert _warnings(caplog) == [
        "reward function timed out after 0.2 s (the call runs on in the background) on a "
        "batch of 4 samples (no sample of it gets a score)"
    ]


def test_a_bad_value_in_a_batch_fails_only_its_sample(caplog):
    scorer = FunctionScore(lambda completions, **kw: [1.0, "1", float("nan")])
    with caplog.at_level("WARNING"):
        assert scorer.score([{}] * 3, ["a", "b", "c"]) == [1.0, None, None]
    assert scorer.failures == 2


def test_weights_are_one_finite_number_per_function():
    for weights in ([1.0], [1.0, float("inf")], [1.0, "2"]):
        with pytest.raises(ValueError, match="reward_weights must be 2 finite numbers"):
            FunctionScore([len, len], reward_weights=weights)
    with pytest.raises(ValueError, match="fn must be a callable or a list of them"):
        FunctionScore([])


def test_per_function_rewards_and_log_metric_are_means_and_log_extra_columns_as_trl_logs():
    """`rewards/<name>/mean` and `/std` over the samples a function scored (population std,
    as `nanstd`... over one batch), `log_metric` values averaged, `log_extra` columns kept."""

    def accuracy(prompts, completions, log_metric, log_extra, **kw):
        log_metric("exact", 0.25)
        log_metric("exact", 0.75)
        log_extra("why", [f"w{c}" for c in completions])
        return [float(c) for c in completions]

    def fmt(problem, completion):
        return None if completion == "3" else 1.0

    scorer = FunctionScore([accuracy, fmt])
    scorer.score([{"prompt": "p"}] * 4, ["0", "1", "2", "3"])
    metrics = scorer.pop_metrics()
    values = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    assert metrics["rewards/accuracy/mean"] == (1.5, 4)
    assert metrics["rewards/accuracy/std"][0] == pytest.approx(float(values.std(False)), abs=1e-12)
    assert metrics["rewards/fmt/mean"] == (1.0, 3) and metrics["rewards/fmt/std"] == (0.0, 3)
    assert metrics["exact"] == (0.5, 2.0)
    assert scorer.pop_extra() == {"why": ["w0", "w1", "w2", "w3"]}
    assert scorer.pop_metrics() == {} and scorer.pop_extra() == {}  # drained


def test_async_functions_are_awaited_together_and_fail_alone():
    """Two async functions overlap (each waits for the other to have started); one that
    raises fails its samples, not the other's."""
    import asyncio

    started = []

    async def a(prompts, completions, **kw):
        started.append("a")
        while "b" not in started:
            await asyncio.sleep(0.001)
        return [1.0] * len(completions)

    async def b(prompts, completions, **kw):
        started.append("b")
        while "a" not in started:
            await asyncio.sleep(0.001)
        return [2.0] * len(completions)

    assert FunctionScore([a, b], timeout=30).score([{"prompt": "p"}] * 2, ["x", "y"]) == [3.0, 3.0]

    async def broken(prompts, completions, **kw):
        raise KeyError("solution")

    scorer = FunctionScore([a, broken], reward_weights=[1.0, 1.0])
    started[:] = ["b"]
    assert scorer.score([{"prompt": "p"}] * 2, ["x", "y"]) == [None, None]
    assert scorer.failures == 2
    with pytest.raises(ValueError, match="async reward function broken must be batched"):
        FunctionScore(broken, batched=False)


def test_the_trainer_state_is_the_trainers_when_reward_functions_read_it():
    """A curriculum reward reads `trainer_state.global_step` (TRL passes transformers'
    TrainerState): the rollout callback keeps it current, from step 0."""
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import HFEngine, SamplingConfig
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.training.module import ComposerModule
    from tests.helpers import quiet_trainer

    seen = []

    def curriculum(prompts, completions, trainer_state, log_metric, log_extra, **kw):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        log_metric("curriculum/level", trainer_state.global_step)
        log_extra("level", [trainer_state.global_step] * len(completions))
        return [float(trainer_state.global_step)] * len(completions)

    cb = RolloutCallback(
        HFEngine(seed=0),
        group_size=2,
        sampling=SamplingConfig(max_tokens=4, seed=0),
        score=FunctionScore(curriculum),
    )
    trainer = quiet_trainer(max_steps=3, callbacks=[cb])
    trainer.fit(
        ComposerModule(tiny_policy_path(), [DrGRPOHead()]),
        RolloutDataModule(task="arithmetic", prompts_per_step=2, val_prompts=0),
    )
    assert seen == [(0, 3), (1, 3), (2, 3)]
    assert float(trainer.callback_metrics["curriculum/level"]) == 2.0  # the last step's
    assert float(trainer.callback_metrics["rewards/curriculum/mean"]) == 2.0
    assert cb._samples[0]["extra"] == {"level": 2}  # the rows of rollouts.jsonl
    dm = RolloutDataModule(task="arithmetic", prompts_per_step=2, val_prompts=2)
    trainer.validate(trainer.lightning_module, dm)
    assert seen[-1] == (3, 3)
    assert float(trainer.callback_metrics["val/rewards/curriculum/mean"]) == 3.0

"""`CollapseWatch`: one line as it happens when accuracy, reply length or truncation collapse."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from composer_lightning.callbacks.collapse import CollapseWatch
from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer, tiny_model


def lengths(watch: CollapseWatch, values: list[float], truncation: float = 0.0) -> list[str]:
    said = []
    for step, v in enumerate(values, start=1):
        metrics = {"rollout/response_length_mean": v, "rollout/truncation_rate": truncation}
        said += watch.observe_step(step, metrics)
    return said


def test_a_length_collapse_is_said_once_with_its_figures():
    watch = CollapseWatch(window=2)
    # first window: 24, 26 -> 25, half of it 12.5; steps 5-6: (13 + 12) / 2 = 12.5, not below;
    # steps 6-7: (12 + 11) / 2 = 11.5 is; steps 7-8 (10.5) are the same fall, not said again
    said = lengths(watch, [24, 26, 20, 16, 13, 12, 11, 10])
    assert said == [
        "composer_lightning: collapse: mean response length fell from 25.0 tokens (first 2 "
        "steps) to 11.5 (steps 6–7)"
    ]


def test_a_fall_that_clears_and_comes_back_is_said_again():
    watch = CollapseWatch(window=1, length_ratio=0.5)
    said = lengths(watch, [20, 9, 8, 15, 5])  # baseline 20: falls at 2, clears at 4, again at 5
    assert [s.split("(")[-1] for s in said] == ["steps 2–2)", "steps 5–5)"]


def test_truncation_rising_past_the_bound_is_a_collapse():
    watch = CollapseWatch(window=2, max_truncation=0.5)
    said = []
    for step, rate in enumerate([0.0, 0.1, 0.3, 0.6, 0.9, 1.0], start=1):
        said += watch.observe_step(step, {"rollout/truncation_rate": rate})
    # first window 0.05; (0.6 + 0.9) / 2 = 0.75 > 0.5 at step 5 (step 4: (0.3 + 0.6) / 2 = 0.45)
    assert said == [
        "composer_lightning: collapse: truncation rate rose from 0.05 (first 2 steps) to 0.75 "
        "(steps 4–5): replies run out of tokens"
    ]
    started_high = CollapseWatch(window=1)
    for step, rate in enumerate([0.9, 0.95], start=1):
        assert started_high.observe_step(step, {"rollout/truncation_rate": rate}) == []


def test_tool_episodes_that_stop_calling_tools_are_a_collapse():
    """The share of tool episodes without a call: first window 0.1; (0.4 + 0.8) / 2 = 0.6 > 0.5
    at step 4; a run whose episodes mostly never called (a task that needs no tool) is not."""
    watch = CollapseWatch(window=2)
    said = []
    for step, rate in enumerate([0.0, 0.2, 0.4, 0.8], start=1):
        said += watch.observe_step(step, {"episode/no_call_rate": rate})
    assert said == [
        "composer_lightning: collapse: share of episodes without a tool call rose from 0.10 "
        "(first 2 steps) to 0.60 (steps 3–4): the policy stopped calling tools"
    ]
    quiet = CollapseWatch(window=1)
    assert quiet.observe_step(1, {"episode/no_call_rate": 0.7}) == []
    assert quiet.observe_step(2, {"episode/no_call_rate": 0.9}) == []


def test_held_out_accuracy_falling_from_its_best():
    watch = CollapseWatch(accuracy_drop=0.2)
    assert watch.observe_validation(0, 0.22) == []
    assert watch.observe_validation(10, 0.63) == []
    assert watch.observe_validation(15, 0.45) == []  # 0.18 below: not yet
    assert watch.observe_validation(20, 0.0) == [
        "composer_lightning: collapse: held-out accuracy fell from 0.630 (step 10) to 0.000 "
        "(step 20)"
    ]
    assert watch.observe_validation(25, 0.0) == []  # said once


def test_the_default_margin_sees_a_collapse_from_a_low_start_but_not_noise():
    # SmolLM2, combine as OpenClaw ships it: 0.109 at step 10, 0.031 at 20 (half of it: 0.0545)
    watch = CollapseWatch()
    assert watch.observe_validation(10, 0.109) == []
    assert watch.observe_validation(20, 0.031) == [
        "composer_lightning: collapse: held-out accuracy fell from 0.109 (step 10) to 0.031 "
        "(step 20)"
    ]
    noisy = CollapseWatch()  # below half, but by less than 0.05: one or two problems of 64
    assert noisy.observe_validation(10, 0.06) == [] and noisy.observe_validation(20, 0.02) == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"accuracy_drop": 0}, "accuracy_drop must be in"),
        ({"length_ratio": 1.0}, "length_ratio must be in"),
        ({"max_truncation": 1.5}, "max_truncation must be in"),
        ({"max_no_call": 0}, "max_no_call must be in"),
        ({"window": 0}, "window must be an integer >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CollapseWatch(**kwargs)


class ShortReplies(L.Callback):
    """Each step's replies 10 tokens long, as the rollout side would report them."""

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.callback_metrics["rollout/response_length_mean"] = torch.tensor(10.0)


def test_the_module_adds_a_watch_unless_the_trainer_has_one_and_it_stops_on_request(caplog):
    module = ComposerModule(tiny_model(), [DrGRPOHead()])
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, SyntheticRolloutDataModule(vocab_size=64))
    assert sum(isinstance(c, CollapseWatch) for c in trainer.callbacks) == 1

    mine = CollapseWatch(window=1, length_ratio=0.9, stop=True)
    mine.first["length"] = 1e9  # as if the run had started with far longer replies
    trainer = quiet_trainer(max_steps=5, callbacks=[ShortReplies(), mine])
    with caplog.at_level(logging.WARNING):
        trainer.fit(
            ComposerModule(tiny_model(), [DrGRPOHead()]), SyntheticRolloutDataModule(vocab_size=64)
        )
    assert [c for c in trainer.callbacks if isinstance(c, CollapseWatch)] == [mine]
    assert len(mine.lines) == 1 and "mean response length fell" in mine.lines[0]
    assert trainer.global_step == 1  # stopped at the first step that saw it
    assert "collapse: mean response length fell" in caplog.text

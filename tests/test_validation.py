"""Held-out validation measures what the run trains for: the run's own score provider, solved at
a threshold, the mean reward beside it; a provider that cannot judge the problems is one line."""

from __future__ import annotations

import json
import logging

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.engines.base import Completion
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.rollout.validation import evaluate
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.tasks import FunctionScore, VerifierHint
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer

POLICY = tiny_policy_path()


class _Chars:
    """A tokenizer of one character per id (what `evaluate` needs: `decode`)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _generate(greedy: list[str], sampled: list[list[str]]):
    def generate(prompts, n, sampling):
        texts = [[g] for g in greedy] if sampling.temperature == 0 else sampled
        assert len(texts) == len(prompts) and all(len(t) == n for t in texts)
        return [[Completion([ord(c) for c in t], [0.0] * len(t), "stop") for t in g] for g in texts]

    return generate


def test_figures_count_a_prompt_solved_at_the_threshold_and_report_the_mean_reward():
    """Scores are the completion's length / 10 ("x" scores None): by hand, with threshold 0.3,
    greedy solves prompts 0 and 2 (0.3, 0.5; not 0.2), pass@2 solves 0, 1 and 2 (0.4, 0.3,
    0.3; prompt 3 has 0.1 and None), the mean reward is over the 7 scored completions of 8."""

    def score(problem, completion):
        return None if completion == "x" else len(completion) / 10

    figures = evaluate(
        _generate(
            ["aaa", "aa", "aaaaa", "a"], [["a", "aaaa"], ["aaa", "a"], ["aa", "aaa"], ["a", "x"]]
        ),
        FunctionScore(score),
        _Chars(),
        prompts=[[1], [2], [3], [4]],
        problems=[{"prompt": str(i)} for i in range(4)],
        sampling=SamplingConfig(temperature=1.0, max_tokens=8),
        k=2,
        seed=0,
        threshold=0.3,
    )
    rewards = [0.1, 0.4, 0.3, 0.1, 0.2, 0.3, 0.1]
    assert figures["accuracy"] == (2 / 4, 4.0)
    assert figures["pass@2"] == (3 / 4, 4.0)
    assert figures["reward_mean"][0] == pytest.approx(sum(rewards) / 7, abs=1e-12)
    assert figures["reward_mean"][1] == 7.0
    assert figures["response_length"] == (16 / 8, 8.0)


def _prompt_file(tmp_path, n=40):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(n))
    )
    return str(path)


def _trainer(cb, **kw):
    return quiet_trainer(
        callbacks=[cb],
        **kw,
    )


def test_validation_uses_the_runs_own_score_by_default(tmp_path, caplog):
    """A custom reward on a prompt file without a task: validation scores with it (the built-in
    verifier would warn once per completion that the problem has no task, and score nothing)."""
    calls = []

    def reward(problem, completion):
        calls.append(problem["answer"])
        return 0.5

    cb = RolloutCallback(
        HFEngine(model_path=POLICY, seed=0),
        group_size=2,
        sampling=SamplingConfig(max_tokens=4, seed=0),
        score=FunctionScore(reward),
        val_samples=2,
        val_threshold=0.5,
    )
    dm = RolloutDataModule(
        tokenizer=POLICY, task=None, prompt_file=_prompt_file(tmp_path), prompts_per_step=4
    )
    module = ComposerModule(POLICY, [DrGRPOHead()], optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    with caplog.at_level(logging.WARNING):
        (figures,) = _trainer(cb, max_steps=1).validate(module, dm)
    held = len(dm.validation_problems())
    assert held > 0 and len(calls) == held * 3  # one greedy and two sampled completions each
    assert figures["val/reward_mean"] == pytest.approx(0.5)
    assert figures["val/accuracy"] == 1.0 and figures["val/pass@2"] == 1.0  # 0.5 >= 0.5
    assert not [r for r in caplog.records if "task" in r.getMessage()]


def test_a_provider_that_cannot_judge_the_problems_is_one_line_at_start(tmp_path):
    """The verifier's hints on a prompt file without a task: one ConfigError naming the
    provider before anything is generated, not a warning per sample."""
    engine = HFEngine(model_path=POLICY, seed=0)
    cb = RolloutCallback(
        engine,
        group_size=2,
        sampling=SamplingConfig(max_tokens=4, seed=0),
        score=FunctionScore(lambda p, c: 1.0),
        hint=VerifierHint(),
    )
    dm = RolloutDataModule(
        tokenizer=POLICY, task=None, prompt_file=_prompt_file(tmp_path), prompts_per_step=4
    )
    module = ComposerModule(POLICY, [DrGRPOHead()])
    with pytest.raises(
        ConfigError, match=r"rollout.hint \(VerifierHint\) cannot judge .*no 'task'"
    ):
        _trainer(cb, max_steps=1).fit(module, dm)
    assert engine.weight_version is None or engine.weight_version == 0  # nothing generated


def test_held_out_lines_of_a_prompt_file_carry_the_datas_task(tmp_path):
    """The verifier finds the task of a held-out line as it does a training line's."""
    dm = RolloutDataModule(tokenizer=POLICY, task="arithmetic", prompt_file=_prompt_file(tmp_path))
    held = dm.validation_problems()
    assert held and all(p["task"] == "arithmetic" for p in held)
    assert RolloutCallback(HFEngine(model_path=POLICY)).val_score.check(held) is None


class _ValWrites(L.pytorch.loggers.Logger):
    """Records each write of held-out figures with its step."""

    name, version, experiment = "val", 0, None

    def __init__(self):
        super().__init__()
        self.writes = []

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if "val/accuracy" in metrics:
            self.writes.append((step, {k: v for k, v in metrics.items() if k.startswith("val/")}))


def _before_train_fit(tmp_path, ckpt_path=None, max_steps=2):
    cb = RolloutCallback(
        HFEngine(model_path=POLICY, seed=0),
        group_size=2,
        sampling=SamplingConfig(max_tokens=4, seed=0),
        val_samples=2,
        val_before_train=True,
    )
    dm = RolloutDataModule(task="arithmetic", prompts_per_step=2, val_prompts=4)
    module = ComposerModule(POLICY, [DrGRPOHead()], optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    logger = _ValWrites()
    trainer = quiet_trainer(
        callbacks=[cb, ckpt],
        logger=logger,
        max_steps=max_steps,
        val_check_interval=2,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return logger.writes, cb, dm


def test_val_before_train_logs_the_untrained_policys_figures_at_step_0(tmp_path):
    """`val_before_train`: held-out figures at step 0, equal to `validate` on the untrained
    policy, then the schedule's own after step 2 (logged at step 1, the step of the training
    figures of the batch it follows, as Lightning logs it); no checkpoint of step 0; a resumed run does not
    evaluate again before its first step."""
    writes, cb, dm = _before_train_fit(tmp_path)
    assert [step for step, _ in writes] == [0, 1]
    module = ComposerModule(POLICY, [DrGRPOHead()])
    (untrained,) = _trainer(cb, max_steps=1).validate(module, dm)
    assert writes[0][1] == pytest.approx(untrained, abs=0)
    assert writes[1][1] != writes[0][1]  # trained at lr 0.5: other figures
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "epoch=0-step=1.ckpt",
        "epoch=0-step=2.ckpt",
    ]
    resumed, _, _ = _before_train_fit(tmp_path / "again", tmp_path / "epoch=0-step=1.ckpt")
    assert [step for step, _ in resumed] == [1]

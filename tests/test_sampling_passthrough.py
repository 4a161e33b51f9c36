"""Sampling and template options as a TRL user sets them (`top_k`, `min_p`,
`repetition_penalty`, `generation_kwargs`, `chat_template_kwargs`) reach the engine and the
chat template in training and held-out evaluation alike; a shaped sampler trains as the
behaviour policy it is. (That the engines' log-probs are those of the shaped distribution is
the engine contract's `shaped_sampling` check, for HF and vLLM.)"""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch

from composer_lightning.chat import render_ids
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer

POLICY = tiny_policy_path()
SHAPED = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, generation_kwargs={"top_p": 0.95})


class Recording(HFEngine):
    """The HF engine, keeping every sampling configuration it was asked to sample with."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.asked: list[SamplingConfig] = []

    def generate(self, prompts, n, sampling):
        self.asked.append(sampling)
        return super().generate(prompts, n, sampling)


class Batches(L.Callback):
    def __init__(self):
        self.shaped = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.shaped.append(batch.rollout.sampler_shaped)


def _fit(sampling: SamplingConfig, steps: int = 2, engine_cls=Recording, **dm_kw):
    engine = engine_cls(model_path=POLICY, seed=0)
    cb = RolloutCallback(engine, group_size=2, sampling=sampling, val_before_train=True)
    batches = Batches()
    module = ComposerModule(POLICY, [DrGRPOHead()])
    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=2, val_prompts=2, **dm_kw)
    trainer = quiet_trainer(max_steps=steps, callbacks=[cb, batches], limit_val_batches=1)
    trainer.fit(module, dm)
    return engine, batches, trainer


def test_a_shaped_sampler_reaches_the_engine_in_training_and_validation_and_trains_weighted():
    sampling = SamplingConfig(max_tokens=6, seed=0, **SHAPED)
    engine, batches, trainer = _fit(sampling)
    assert batches.shaped == [True, True]
    for asked in engine.asked:  # training's and validation's, greedy included
        assert (asked.top_k, asked.min_p, asked.repetition_penalty) == (20, 0.05, 1.2)
        assert asked.generation_kwargs == {"top_p": 0.95}
    assert any(a.temperature == 0 for a in engine.asked)  # the greedy held-out pass
    metrics = trainer.callback_metrics
    assert "val/accuracy" in metrics
    # the engine's log-probs are μ's: importance weights, and no log-prob canary (the default
    # threshold would stop the run), while the push is still checked by its fingerprint
    assert 0 < float(metrics["ppo/is_weight_mean"]) <= 2.0
    assert "rollout/logprob_gap_mean" not in metrics
    assert float(metrics["rollout/fingerprint_params"]) > 0


def test_an_unshaped_sampler_stays_on_policy():
    engine, batches, trainer = _fit(SamplingConfig(max_tokens=6, seed=0), steps=1)
    assert batches.shaped == [False]
    assert "ppo/is_weight_mean" not in trainer.callback_metrics
    assert float(trainer.callback_metrics["rollout/logprob_gap_mean"]) < 1e-5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_p": 1.0}, "min_p must be in [0, 1) (0: off), got 1.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0 (1: off), got 0.0"),
        ({"generation_kwargs": ["top_p"]}, "generation_kwargs must be a mapping"),
    ],
)
def test_bad_sampling_options_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingConfig(**kwargs)
    assert message in str(err.value)


def _thinking_tokenizer_dir(tmp_path) -> str:
    """The tiny policy with a chat template that reads `enable_thinking`, as Qwen3's does."""
    path = tmp_path / "policy"
    shutil.copytree(POLICY, path)
    template = (path / "chat_template.jinja").read_text()
    switch = "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    (path / "chat_template.jinja").write_text(
        template.replace("<|assistant|>{% endif %}", "<|assistant|>" + switch + "{% endif %}")
    )
    return str(path)


def test_chat_template_kwargs_reach_every_rendered_chat(tmp_path):
    policy = _thinking_tokenizer_dir(tmp_path)
    plain = RolloutDataModule(tokenizer=policy, prompts_per_step=2)
    quiet = RolloutDataModule(
        tokenizer=policy, prompts_per_step=2, chat_template_kwargs={"enable_thinking": False}
    )
    problem = plain.problems(0)[0]
    switch = plain.tokenizer("/no_think", add_special_tokens=False)["input_ids"]
    with_ids, without = quiet.prompt_ids(problem), plain.prompt_ids(problem)
    assert with_ids == without + switch
    # any chat the run renders through the tokenizer (hinted contexts, episodes) alike
    chat = [{"role": "user", "content": "2+2?"}]
    assert (
        render_ids(quiet.tokenizer, chat, True) == render_ids(plain.tokenizer, chat, True) + switch
    )
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        RolloutDataModule(tokenizer=policy, chat_template_kwargs="enable_thinking=false")


def test_chat_template_kwargs_train_through_the_run(tmp_path):
    """Training and validation prompts carry the template variable: the engine is asked for
    prompts that end with it."""
    policy = _thinking_tokenizer_dir(tmp_path)

    class Prompts(Recording):
        prompts: list = []

        def generate(self, prompts, n, sampling):
            Prompts.prompts += prompts
            return super().generate(prompts, n, sampling)

    engine = Prompts(model_path=policy, seed=0)
    cb = RolloutCallback(
        engine, group_size=2, sampling=SamplingConfig(max_tokens=4, seed=0), val_before_train=True
    )
    module = ComposerModule(policy, [DrGRPOHead()])
    dm = RolloutDataModule(
        prompts_per_step=2, val_prompts=2, chat_template_kwargs={"enable_thinking": False}
    )
    quiet_trainer(max_steps=1, callbacks=[cb], limit_val_batches=1).fit(module, dm)
    switch = dm.tokenizer("/no_think", add_special_tokens=False)["input_ids"]
    assert len(Prompts.prompts) >= 4
    assert all(p[-len(switch) :] == switch for p in Prompts.prompts)


def test_model_init_kwargs_reach_the_policy_reference_and_teacher_loads():
    from composer_lightning.heads.kl import KLHead

    options = {"attn_implementation": "eager", "dtype": "float64"}
    module = ComposerModule(
        POLICY, [DrGRPOHead(), KLHead()], teacher=POLICY, model_init_kwargs=options
    )
    default = ComposerModule(POLICY, [DrGRPOHead()], teacher=POLICY)
    for model in (module.policy, module.reference, module.teacher):
        assert model.config._attn_implementation == "eager"
        assert next(model.parameters()).dtype == torch.float64
    assert default.policy.config._attn_implementation != "eager"
    assert next(default.teacher.parameters()).dtype == torch.float32
    explicit = ComposerModule(
        POLICY, [DrGRPOHead(), KLHead()], reference=POLICY, model_init_kwargs=options
    )
    assert next(explicit.reference.parameters()).dtype == torch.float64
    with pytest.raises(ValueError, match="model_init_kwargs must be a mapping"):
        ComposerModule(POLICY, [DrGRPOHead()], model_init_kwargs="eager")

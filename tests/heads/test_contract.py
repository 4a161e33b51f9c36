"""The head contract, run over every registered head, and the heads' bad-input errors."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads import (
    REQUIREMENTS,
    Head,
    HeadOutput,
    LinearRamp,
    LinearWarmup,
    registry,
)
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.training.module import ComposerModule
from tests.helpers import context, tiny_model

NAMES = sorted(registry.registered())


@pytest.fixture(scope="module")
def ctx_and_batch():
    batch = synthetic_batch(
        torch.Generator().manual_seed(0), prompts=3, group_size=4, vocab_size=64
    )
    # replies sampled with the hint in context, for the heads that imitate them: one per
    # group, its reward 1
    ids = batch.input_ids[::4].clone()
    batch.hinted = RolloutBatch(
        input_ids=ids,
        attention_mask=batch.attention_mask[::4].clone(),
        response_mask=batch.response_mask[::4].clone(),
        rewards=torch.ones(len(ids)),
        has_reward=torch.ones(len(ids), dtype=torch.bool),
        group_ids=batch.group_ids[::4].clone(),
        max_response_length=batch.max_response_length,
    )
    module = ComposerModule(tiny_model(), [registry.load("kl")(), registry.load("topk_opd")()])
    ctx = context(module, batch, set(REQUIREMENTS))
    return ctx, batch


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_head_honours_the_contract(name, ctx_and_batch):
    ctx, batch = ctx_and_batch
    cls = registry.load(name)
    assert issubclass(cls, Head) and cls.__doc__
    head = cls()
    assert head.name == name and set(head.requires) <= REQUIREMENTS
    head.on_rollout(batch, ctx.old_logprobs)
    out = head.compute(batch, ctx)
    assert isinstance(out, HeadOutput)
    if out.advantages is not None:
        assert out.advantages.shape == batch.input_ids.shape and not out.advantages.requires_grad
        assert torch.all(out.advantages[~batch.response_mask] == 0)
    else:
        assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    for k, v in out.metrics.items():
        assert isinstance(k, str) and "/" not in k
        assert math.isfinite(float(v))
    state = head.state_dict()
    cls().load_state_dict(state)
    # the signature of compute is exactly the protocol's
    assert list(inspect.signature(cls.compute).parameters) == ["self", "batch", "ctx"]


def test_schedules():
    w = LinearWarmup(4)
    assert [w(s) for s in (0, 2, 4, 10)] == [0.0, 0.5, 1.0, 1.0]
    r = LinearRamp(1.0, 0.0, start_step=10, end_step=20)
    assert [r(s) for s in (0, 10, 15, 20, 30)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    h = registry.load("opd")(weight=2.0, schedule=r)
    assert h.effective_weight(15) == 1.0


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: registry.load("dr_grpo")(weight=-1.0), "weight must be finite and >= 0, got -1.0"),
        (lambda: registry.load("dr_grpo")(weight=float("nan")), "got nan"),
        (lambda: registry.load("sdpo")(beta=1.5), "beta must be in \\[0, 1\\], got 1.5"),
        (lambda: registry.load("sdpo")(temperature=0.0), "temperature must be > 0, got 0.0"),
        (lambda: registry.load("sdpo")(clip=0.0), "clip must be > 0 or None, got 0.0"),
        (
            lambda: registry.load("sdpo")(clip_mode="row"),
            "clip_mode must be 'scale', 'element' or 'token', got 'row'",
        ),
        (
            lambda: registry.load("kl")(estimator="k4"),
            "estimator must be 'k1', 'k2' or 'k3', got 'k4'",
        ),
        (
            lambda: registry.load("kl")(estimator="k1", placement="loss"),
            "'k1' cannot be used in the loss",
        ),
        (lambda: registry.load("replay_dpo")(beta=0.0), "beta must be > 0, got 0.0"),
        (lambda: LinearWarmup(-3), "warmup_steps must be an integer >= 0, got -3"),
        (
            lambda: LinearRamp(1.0, 0.0, start_step=5, end_step=2),
            "end_step \\(2\\) must be >= start_step \\(5\\)",
        ),
    ],
)
def test_head_bad_input_names_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(aggregation="sum"), "sum"),
        (dict(clip_low=0.0), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(mixing="both"), "mixing must be one of .* got 'both'"),
        (
            dict(temperature=0.0),
            r"temperature must be > 0 or None \(the sampling temperature\), got 0.0",
        ),
        (dict(ppo_epochs=0), "ppo_epochs must be an integer >= 1, got 0"),
        (dict(variance_matching="nope"), "variance_matching names head 'nope'"),
    ],
)
def test_module_bad_settings_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ComposerModule(tiny_model(), [registry.load("dr_grpo")()], **kwargs)


def test_duplicate_head_names_are_refused():
    with pytest.raises(ValueError, match="duplicate head names \\['dr_grpo'\\]"):
        ComposerModule(tiny_model(), [registry.load("dr_grpo")(), registry.load("dr_grpo")()])


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found or has no config.json"):
        ComposerModule(str(tmp_path / "nope"), [registry.load("dr_grpo")()])

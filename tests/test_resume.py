"""Resuming with a configuration that differs from the checkpoint's (`resume.py`): the
configuration wins where that is sound, one line per difference; the rest is one error."""

from __future__ import annotations

import glob

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.runtime.resume import differences
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer, tiny_model


def _module(lr, weight_decay=0.01, gamma=None, **kw) -> ComposerModule:
    def optimizer(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)

    return ComposerModule(
        tiny_model(torch.float32),
        [DrGRPOHead()],
        optimizer=optimizer,
        lr_scheduler=None if gamma is None else schedule,
        max_logprob_gap=None,
        **kw,
    )


def _fit(module, steps, tmp_path, ckpt_path=None) -> L.Trainer:
    callbacks = [] if ckpt_path else [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path)]
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=callbacks,
    )
    trainer.fit(module, SyntheticRolloutDataModule(vocab_size=64), ckpt_path=ckpt_path)
    return trainer


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("composer_lightning")]


def test_a_resumed_run_trains_with_the_configured_lr_and_optimizer_settings(tmp_path, caplog):
    _fit(_module(3e-4), 2, tmp_path)
    ckpt = glob.glob(str(tmp_path / "*.ckpt"))[0]
    with caplog.at_level("WARNING"):
        trainer = _fit(_module(1e-4, weight_decay=0.1), 3, tmp_path, ckpt)
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == 1e-4 and opt.param_groups[0]["weight_decay"] == 0.1
    assert all(int(s["step"]) == 3 for s in opt.state.values())  # the moments were restored
    assert _warnings(caplog) == [
        "resuming with lr 0.0001 (the checkpoint was trained with 0.0003)",
        "resuming with weight_decay 0.1 (the checkpoint was trained with 0.01)",
    ]


def test_a_resumed_run_follows_the_configured_schedule_from_the_step_reached(tmp_path, caplog):
    """lr 1e-3 halved per step for 2 steps, resumed with lr 2e-3 and a tenth per step: the
    third step ends at 2e-3 · 0.1³, as a run with the new settings throughout would."""
    _fit(_module(1e-3, gamma=0.5), 2, tmp_path)
    ckpt = glob.glob(str(tmp_path / "*.ckpt"))[0]
    with caplog.at_level("WARNING"):
        trainer = _fit(_module(2e-3, gamma=0.1), 3, tmp_path, ckpt)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(2e-3 * 0.1**3, rel=1e-12)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3
    assert _warnings(caplog) == [
        "resuming with lr 0.002 (the checkpoint was trained with 0.001)",
        "resuming with lr_scheduler gamma 0.1 (the checkpoint was trained with 0.5)",
    ]


def _config(**changes) -> dict:
    heads = [
        {"class_path": "composer_lightning.heads.dr_grpo.DrGRPOHead", "init_args": {"weight": 1}},
        {
            "class_path": "composer_lightning.heads.opd.OPDHead",
            "init_args": {"weight": 0.5, "name": None, "schedule": None},
        },
    ]
    config = {
        "policy": "models/a",
        "heads": heads,
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4}},
        "clip_low": 0.2,
        "teacher": None,
    }
    return {**config, **changes}


def test_settings_are_honoured_and_another_optimizer_or_head_class_is_refused():
    heads = _config()["heads"]
    warmup = {"class_path": "composer_lightning.heads.schedules.LinearWarmup"}
    honoured = [
        heads[0],
        {
            **heads[1],
            "init_args": {"weight": 0.3, "schedule": {**warmup, "init_args": {"warmup_steps": 5}}},
        },
    ]
    found = differences(
        _config(),
        _config(policy="moved/a", heads=honoured, clip_low=0.1, teacher="models/t"),
    )
    assert found.refused == []
    assert found.honoured == [
        "resuming with clip_low 0.1 (the checkpoint was trained with 0.2)",
        "resuming with policy moved/a (the checkpoint was trained with models/a); the weights "
        "are the checkpoint's",
        "resuming with teacher models/t (the checkpoint was trained with None)",
        "resuming with opd schedule LinearWarmup(warmup_steps=5) (the checkpoint was trained "
        "with None)",
        "resuming with opd weight 0.3 (the checkpoint was trained with 0.5)",
    ]
    sdpo = {"class_path": "composer_lightning.heads.sdpo.SDPOHead", "init_args": {"name": "opd"}}
    found = differences(
        _config(), _config(optimizer={"class_path": "torch.optim.SGD"}, heads=[heads[0], sdpo])
    )
    assert found.honoured == []
    with pytest.raises(ConfigError) as err:
        found.raise_refused()
    assert str(err.value) == (
        "cannot resume from this checkpoint with this configuration: optimizer torch.optim.SGD "
        "(the checkpoint was trained with torch.optim.AdamW, whose saved state means nothing to "
        "another class); head opd is a SDPOHead (the checkpoint's is a OPDHead): give it another "
        "name to start it fresh"
    )


def test_a_policy_of_another_shape_is_refused_in_the_same_error():
    first = _module(1e-4)
    checkpoint: dict = {"state_dict": first.state_dict()}
    first.on_save_checkpoint(checkpoint)
    other = ComposerModule(tiny_model(torch.float32, vocab_size=128), [DrGRPOHead()])
    with pytest.raises(ConfigError) as err:
        other.on_load_checkpoint(checkpoint)
    assert str(err.value) == (
        "cannot resume from this checkpoint with this configuration: the policy's parameters are "
        "not the checkpoint's (0 names and 2 shapes differ: lm_head.weight is [128, 32] here, "
        "[64, 32] in the checkpoint): resume with the model the checkpoint trained"
    )


def test_checkpoints_leave_the_frozen_models_out_and_the_configured_ones_stay():
    """The module's state dict (what every checkpoint stores) holds the policy alone. Resuming
    from an older checkpoint with a teacher copy in it, with that teacher swapped for another
    and a reference added by a KL head (allowed), keeps the configured ones: the strict load
    passes and changes neither."""
    first = ComposerModule(
        tiny_model(torch.float32), [DrGRPOHead()], teacher=tiny_model(torch.float32, seed=1)
    )
    state = first.state_dict()
    assert state and all(k.startswith("policy.") for k in state)
    older = {f"teacher.{k}": v for k, v in first.teacher.state_dict().items()}
    checkpoint: dict = {"state_dict": {**state, **older}}
    first.on_save_checkpoint(checkpoint)
    second = ComposerModule(
        tiny_model(torch.float32),
        [DrGRPOHead(), KLHead(kl_coef=0.1)],
        teacher=tiny_model(torch.float32, seed=2),
        allow_head_changes=True,
    )
    frozen = {"reference": second.reference, "teacher": second.teacher}
    expected = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in frozen.items()}
    second.on_load_checkpoint(checkpoint)
    second.load_state_dict(checkpoint["state_dict"])  # strict: only the frozen models are absent
    for name, model in frozen.items():
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[name][key]), (name, key)
    assert not torch.equal(expected["teacher"]["lm_head.weight"], older["teacher.lm_head.weight"])


def test_a_changed_group_size_sampling_or_data_setting_is_honoured_with_one_line_each(caplog):
    saved_cb = RolloutCallback(HFEngine(), group_size=4, sampling=SamplingConfig(max_tokens=8))
    cb = RolloutCallback(HFEngine(), group_size=2, sampling=SamplingConfig(max_tokens=16))
    saved_dm = RolloutDataModule(tokenizer=None, prompts_per_step=8, seed=0)
    dm = RolloutDataModule(tokenizer=None, prompts_per_step=4, seed=1)
    with caplog.at_level("WARNING"):
        cb.load_state_dict(saved_cb.state_dict())
        dm.load_state_dict(saved_dm.state_dict())
    assert cb.group_size == 2 and dm.prompts_per_step == 4
    assert _warnings(caplog) == [
        "resuming with group_size 2 (the checkpoint was trained with 4)",
        "resuming with sampling max_tokens 16 (the checkpoint was trained with 8)",
        "resuming with data seed 1 (the checkpoint was trained with 0)",
        "resuming with data prompts_per_step 4 (the checkpoint was trained with 8)",
    ]


def test_the_number_of_ranks_is_judged_against_the_run_about_to_start():
    """The command line checks before the ranks exist: against the trainer's world size."""
    module = _module(1e-4)
    ranks = [{"heads": {"dr_grpo": {}}, "rng": None}] * 2
    checkpoint = {"composer": {"policy_version": 3, "ranks": ranks}}
    assert module.resume_differences(checkpoint, 2).refused == []
    assert module.resume_differences(checkpoint, 1).refused == [
        "the checkpoint holds per-rank state of 2 ranks, this run has 1: resume with the same "
        "number of ranks"
    ]

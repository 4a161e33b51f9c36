"""One step axis: with several optimizer steps per rollout batch (ppo_epochs × minibatches),
max_steps, validation, checkpoints, the loggers' steps and the lr schedule all count optimizer
steps (`callbacks/steps.py`)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

import composer_lightning.callbacks.steps as steps_file
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer


class Steps(Logger):
    """Records the step of each write, and whether it held training or held-out figures."""

    def __init__(self):
        super().__init__()
        self.writes = []

    name, version = "steps", 0

    @property
    def experiment(self):
        return None

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        kind = "val" if any(k.startswith("val/") for k in metrics) else "train"
        if kind == "val" or "train/loss" in metrics:
            self.writes.append((kind, step))


def _fit(tmp_path, **trainer):
    module = ComposerModule(
        tiny_policy_path(),
        [DrGRPOHead()],
        ppo_epochs=2,
        minibatches=2,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    )
    cb = RolloutCallback(
        HFEngine(seed=0), group_size=2, sampling=SamplingConfig(max_tokens=4, seed=0), val_samples=1
    )
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        tmp_path, every_n_train_steps=trainer.pop("every", 4), save_top_k=-1
    )
    logger = Steps()
    fit = quiet_trainer(
        callbacks=[cb, ckpt],
        logger=logger,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        **trainer,
    )
    fit.fit(module, RolloutDataModule(task="arithmetic", prompts_per_step=2, val_prompts=2))
    return fit, module, logger


def test_validation_logging_checkpoints_and_the_schedule_count_optimizer_steps(tmp_path):
    trainer, module, logger = _fit(
        tmp_path, max_steps=12, val_check_interval=8, num_sanity_val_steps=0
    )
    assert trainer.global_step == 12 and module.policy_version == 3  # 3 batches × 4 updates
    assert logger.writes == [("train", 3), ("train", 7), ("val", 7), ("train", 11)]
    saved = sorted(int(p.stem.split("step=")[1]) for p in tmp_path.glob("*.ckpt"))
    assert saved == [4, 8, 12]
    lr = module.optimizers().optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3 / 13, rel=1e-12)  # 12 scheduler steps: one per update


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (dict(max_steps=10), "trainer.max_steps=10"),
        (dict(max_steps=12, val_check_interval=10), "trainer.val_check_interval=10"),
        (dict(max_steps=12, every=6), "ModelCheckpoint.every_n_train_steps=6"),
    ],
)
def test_a_count_between_batches_is_one_line_at_setup(tmp_path, option, message):
    with pytest.raises(ConfigError) as err:
        _fit(tmp_path, **option)
    assert str(err.value).startswith(f"{message} counts optimizer steps, and a rollout batch ")
    assert "makes 4 (model.ppo_epochs × model.minibatches)" in str(err.value)


def test_a_run_that_early_stopping_ends_says_so_in_one_line(tmp_path, monkeypatch):
    # the line is read where the callback writes it (Lightning's rank-zero info), not from the
    # logging tree: whether Lightning's loggers reach pytest's handler depends on the tests and
    # the log configuration before this one (a full suite run once lost the line there)
    said: list[str] = []
    monkeypatch.setattr(steps_file, "rank_zero_info", said.append)
    # a threshold every accuracy passes: the tiny policy's accuracy on two prompts is chance (a
    # CI machine once read 0.0 at step 2, which a threshold of 0.0 does not stop on)
    stop = L.pytorch.callbacks.EarlyStopping("val/accuracy", mode="max", stopping_threshold=-1.0)
    module = ComposerModule(tiny_policy_path(), [DrGRPOHead()])
    cb = RolloutCallback(HFEngine(seed=0), group_size=2, sampling=SamplingConfig(max_tokens=4))
    trainer = quiet_trainer(
        callbacks=[cb, stop], max_steps=5, val_check_interval=2, num_sanity_val_steps=0
    )
    trainer.fit(module, RolloutDataModule(task="arithmetic", prompts_per_step=2, val_prompts=2))
    lines = [line for line in said if "stopped early" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "stopped early at step 2 of 5 by EarlyStopping: Stopping threshold reached: val/accuracy"
    ), lines

"""Whichever logger is configured, a run's files are in one directory (the one its checkpoints
go to) and sampled completions reach the logger's own table or text API."""

from __future__ import annotations

import glob
import json
import os

import lightning as L
import pytest
import torch
from jsonargparse import Namespace

from composer_lightning.callbacks.curves import Curves
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.command_line import one_run_dir
from composer_lightning.runtime.rundir import run_dir
from composer_lightning.training.module import ComposerModule

POLICY = tiny_policy_path()


def _logger(kind: str, save_dir: str, monkeypatch):
    from lightning.pytorch import loggers

    if kind == "csv":
        return loggers.CSVLogger(save_dir, name="run")
    if kind == "wandb":
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        return loggers.WandbLogger(save_dir=save_dir, project="proj", offline=True)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 asks for a database
    return loggers.MLFlowLogger(experiment_name="exp", save_dir=os.path.join(save_dir, "mlruns"))


def _sent_to_logger(kind: str, logger, save_dir: str) -> bool:
    if kind == "wandb":  # the offline run's table file
        return bool(glob.glob(f"{save_dir}/wandb/offline-run-*/files/media/table/rollouts_*"))
    if kind == "mlflow":
        artifacts = logger.experiment.list_artifacts(logger.run_id, "rollouts")
        return [os.path.basename(a.path) for a in artifacts] == ["step_000000.md", "step_000001.md"]
    return True  # a CSV logger has no table API: rollouts.jsonl is beside its metrics


@pytest.mark.parametrize("kind", ["csv", "wandb", "mlflow"])
def test_the_run_directory_follows_the_logger(kind, tmp_path, monkeypatch):
    logger = _logger(kind, str(tmp_path), monkeypatch)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=1, save_last=True)
    rollout = RolloutCallback(
        HFEngine(model_path=POLICY, seed=0),
        group_size=2,
        sampling=SamplingConfig(max_tokens=4, seed=0),
        samples_every_n_steps=1,
        samples_per_step=2,
    )
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        default_root_dir=str(tmp_path / "root"),
        logger=logger,
        callbacks=[rollout, checkpoints, Curves()],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = ComposerModule(POLICY, [DrGRPOHead()], optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    try:
        trainer.fit(module, RolloutDataModule(tokenizer=POLICY, prompts_per_step=2))
        where = run_dir(trainer)
        assert os.path.dirname(checkpoints.dirpath) == where
        assert os.path.isfile(os.path.join(where, "checkpoints", "last.ckpt"))
        assert os.path.isfile(os.path.join(where, "curves.png"))
        with open(os.path.join(where, "rollouts.jsonl")) as f:
            assert [json.loads(line)["step"] for line in f] == [0, 0, 1, 1]
        assert _sent_to_logger(kind, logger, str(tmp_path))
    finally:
        if kind == "wandb":
            import wandb

            wandb.finish()


def _trainer_section(logger: dict, root: str | None = None) -> Namespace:
    section = Namespace(
        logger=Namespace(
            class_path=logger["class_path"], init_args=Namespace(**logger["init_args"])
        )
    )
    if root is not None:
        section.default_root_dir = root
    return section


def test_a_logger_saving_in_the_working_directory_by_default_saves_in_the_run():
    """W&B's save_dir "." and MLflow's "./mlruns" are their classes' defaults: the run's root
    replaces them, silently; a save_dir the user gave stays unless default_root_dir is given."""
    wandb = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": "."}}
    section = _trainer_section(wandb)
    assert one_run_dir(section, "runs/cfg") is None
    assert section.logger.init_args.save_dir == "runs/cfg"
    mlflow = {
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"save_dir": "./mlruns"},
    }
    section = _trainer_section(mlflow, root="/tmp/elsewhere")
    assert one_run_dir(section, "runs/cfg") is None
    assert section.logger.init_args.save_dir == "/tmp/elsewhere"
    csv = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "logs"}}
    section = _trainer_section(csv)
    assert one_run_dir(section, "runs/cfg") is None and section.logger.init_args.save_dir == "logs"
    section = _trainer_section(csv, root="/tmp/r")
    assert "wins over the logger's save_dir 'logs'" in one_run_dir(section, "runs/cfg")
    assert section.logger.init_args.save_dir == "/tmp/r"


@pytest.mark.slow  # a fit through the command line
def test_a_wandb_run_from_the_command_line_keeps_everything_in_its_directory(tmp_path):
    """`--trainer.logger=WandbLogger` (save_dir "." by default): W&B's files, the checkpoints,
    rollouts.jsonl and curves.png all under the run's root, nothing in the working directory."""
    from tests.helpers import ROOT, run_cli

    project = "composer_lightning_test_project"
    before = set(os.listdir(ROOT))
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny_cpu_hf.yaml"),
        "--trainer.max_steps=2",
        "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
        "--trainer.logger.init_args.offline=true",
        f"--trainer.logger.init_args.project={project}",
        "--rollout.init_args.samples_every_n_steps=1",
        f"--trainer.default_root_dir={tmp_path}",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(os.listdir(ROOT)) == before
    (run,) = glob.glob(f"{tmp_path}/{project}/*")
    assert sorted(os.listdir(run)) == ["checkpoints", "curves.png", "report.html", "rollouts.jsonl"]
    assert os.path.isfile(os.path.join(run, "checkpoints", "last.ckpt"))
    assert glob.glob(f"{tmp_path}/wandb/offline-run-*/files/media/table/rollouts_*")

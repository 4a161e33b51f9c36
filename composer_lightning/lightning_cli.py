"""`ComposerCLI`: Lightning's CLI as `fit`, `validate`, `test`, `predict` and `serve` run it.

Over LightningCLI it adds the `rollout:` section, a run directory named after the config
(`runs/<config name>`), the run report at the end of every fit, the checks before a fit starts
(`runtime/command_line.py`), bf16 on CPU only where the CPU has bf16 units
(`runtime/cpu_precision.py`), and one line instead of a traceback for a configuration error or
one of the run's own stops. `run` builds it and runs the command; `cli.main` calls it, so a
command that is not Lightning's never imports Lightning.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import lightning as L
from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from composer_lightning.callbacks.curves import Curves
from composer_lightning.callbacks.progress import StepProgress
from composer_lightning.report.callback import with_run_report
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.command_line import (
    check_mode,
    help_formatter,
    one_run_dir,
    refuse_resume,
    release_process_group,
    run_summary,
)
from composer_lightning.runtime.config_errors import config_error_line
from composer_lightning.runtime.cpu_precision import resolve_cpu_precision
from composer_lightning.runtime.distributed import RankError
from composer_lightning.runtime.errors import ConfigError, storage_error
from composer_lightning.runtime.overrides import is_overlay
from composer_lightning.tasks.base import ScoringError
from composer_lightning.training.module import ComposerModule, OutOfSyncError


class ComposerCLI(LightningCLI):
    """LightningCLI over `ComposerModule`, any data module and the `rollout:` section.

    Args:
        command: the subcommand being run (only its parser is built).
        serving: run as `serve` (the config's rollout side must be a `ServeCallback`).
    """

    def __init__(self, *args: Any, command: str | None, serving: bool, **kwargs: Any):
        self._command, self._serving = command, serving
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # static there
        # The parser of the subcommand being run only: LightningCLI builds one for each of
        # fit, validate, test and predict (≈ 0.2 s each, every class signature read), and
        # a run uses one. An unknown subcommand gets all four, for the parser's error.
        every = LightningCLI.subcommands()
        return {self._command: every[self._command]} if self._command in every else every

    def add_arguments_to_parser(self, parser) -> None:
        # The rollout side is its own section (`rollout:`, `--rollout.group_size=8`,
        # `--rollout.engine.init_args.seed=1`), not an entry of trainer.callbacks; configs
        # whose data module yields rollout batches itself leave it out.
        parser.add_lightning_class_args(
            RolloutCallback, "rollout", subclass_mode=True, required=False
        )

    def _instantiate_trainer(self, config, callbacks):
        if not config.get("default_root_dir"):  # never the working tree: runs/<config name>
            config["default_root_dir"] = os.path.join("runs", self._run_name())
        # the run report at the end of every fit, unless the config has its own
        callbacks = with_run_report(config.get("callbacks"), [c for c in callbacks if c])
        return super()._instantiate_trainer(config, callbacks)

    def before_fit(self) -> None:
        # what cannot be honoured is said before any engine starts
        refuse_resume(self.trainer, self.model, self.config.fit.get("ckpt_path"))
        check_mode(self.trainer, self._serving)
        # one line instead of Lightning's model summary table
        if self.trainer.is_global_zero:
            print(run_summary(self.model, self.trainer), flush=True)

    def before_instantiate_classes(self) -> None:
        section = self.config.get(str(self.subcommand)) if self.subcommand else self.config
        trainer = section.get("trainer") if section is not None else None
        said = [
            one_run_dir(trainer, os.path.join("runs", self._run_name())),
            resolve_cpu_precision(trainer),  # bf16 on CPU only where it has bf16 units
        ]
        for say in said:
            if say and rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set on import
                print(f"composer_lightning: {say}", flush=True)

    def _run_name(self) -> str:
        files = (self.config.get(str(self.subcommand), self.config) or {}).get("config") or []
        files = [f for f in files if not is_overlay(str(f))]
        return os.path.splitext(os.path.basename(str(files[0])))[0] if files else "run"

    def parse_arguments(self, parser, args) -> None:
        # A value the parser refuses (a wrong type, a Literal option not among its choices)
        # is a configuration error too: one line naming the key and the choices.
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as exc:
            raise SystemExit(
                f"composer_lightning: invalid configuration: {config_error_line(exc)}"
            ) from None

    def _parse_ckpt_path(self) -> None:
        # A checkpoint that cannot be read (truncated, not a checkpoint) is refused here,
        # before anything is built or started, in one line naming the file. LightningCLI
        # would also replace the `model:` section with the checkpoint's hyper-parameters,
        # silently ignoring a changed lr or head list: a resumed fit is built from its own
        # configuration and compared with the checkpoint (`runtime/resume.py`).
        path = self.config[self.config.subcommand].get("ckpt_path")
        try:
            if self.config.get("subcommand") != "fit":
                super()._parse_ckpt_path()
            elif path and os.path.isfile(path):  # readable? (a sharded directory: later)
                import torch

                torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
            reason = str(exc).split(". ")[0]  # torch's advice on corrupt files follows
            raise SystemExit(
                f"composer_lightning: cannot read checkpoint {path} (truncated, or not a "
                f"checkpoint): {reason}"
            ) from None

    def instantiate_classes(self) -> None:
        # Errors while building the configured objects are configuration errors: say what
        # is wrong in one line instead of a traceback.
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
            raise SystemExit(
                f"composer_lightning: invalid configuration: {config_error_line(exc)}"
            ) from None


def run(args: list[str] | None, serving: bool) -> None:
    """Run a Lightning command (`args`: the subcommand and its options; None: `sys.argv`'s),
    its failures said in one line: a configuration error, one of the run's own stops
    (`RankError`, `OutOfSyncError`, `ScoringError`), or a full or read-only disk."""
    import sys

    command = (sys.argv[1:] if args is None else args)[:1]
    try:
        ComposerCLI(
            ComposerModule,
            L.LightningDataModule,
            command=command[0] if command else None,
            serving=serving,
            subclass_mode_data=True,
            args=args,
            auto_configure_optimizers=False,  # ComposerModule takes its own optimizer
            trainer_defaults={
                "callbacks": [StepProgress(), Curves()],
                "enable_model_summary": False,
            },
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False, "formatter_class": help_formatter()},
        )
    except ConfigError as exc:  # parts that disagree, found at setup, before any engine starts
        raise SystemExit(f"composer_lightning: invalid configuration: {exc}") from None
    except (RankError, OutOfSyncError, ScoringError) as exc:  # the run's own stops: one line
        raise SystemExit(f"composer_lightning: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # a full or read-only disk: the path and the OS error, one line
        line = storage_error(exc)
        if line is None:
            raise
        raise SystemExit(f"composer_lightning: {line}") from None
    finally:
        release_process_group()

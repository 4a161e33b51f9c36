"""The command line: `python -m composer_lightning fit --config <yaml>` and `... heads`."""

from __future__ import annotations

import os
import pickle
import sys
import warnings

from composer_lightning.heads import registry


def list_heads(stream=sys.stdout) -> int:
    """Print `name → class_path` for every registered head; report broken plugins by name."""
    entries = registry.load_all()
    width = max(len(e.name) for e in entries)
    for e in entries:
        if e.error is None:
            doc = (e.cls.__doc__ or "").strip().splitlines()
            print(
                f"{e.name:<{width}}  {e.class_path}  {doc[0] if doc else ''}".rstrip(), file=stream
            )
        else:
            print(f"{e.name:<{width}}  {e.class_path}  FAILED TO IMPORT: {e.error}", file=stream)
    return 0


def _quiet() -> None:
    """Warnings and reports that say nothing to a user of the command line."""
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)"
    )  # Lightning/torch
    # the frozen reference and teacher are in eval mode on purpose
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    # checkpoints are taken after the step's updates and push, which is what a resume needs
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars of from_pretrained
    import threading

    report = threading.excepthook

    def excepthook(args) -> None:
        # A thread that keeps its exception for its owner to raise (TensorBoard's writer: the
        # next log call raises it in the main thread, which reports it) is not reported twice.
        if getattr(args.thread, "exception", None) is not args.exc_value:
            report(args)

    threading.excepthook = excepthook


def run_summary(module, trainer) -> str:
    """`composer_lightning: <policy> (N params), heads ..., engine ..., steps ..., logs in ...`"""
    from composer_lightning.callbacks.samples import run_dir

    params = sum(p.numel() for p in module.policy.parameters())
    heads = ", ".join(f"{h.name}×{h.weight:g}" for h in module.heads)
    engine = next(
        (type(c.engine).__name__ for c in trainer.callbacks if hasattr(c, "engine")), "none"
    )
    steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "∞"
    where = run_dir(trainer)  # not trainer.log_dir: a collective, and this runs on rank 0
    return (
        f"composer_lightning: policy {module.policy_path or type(module.policy).__name__} "
        f"({params / 1e6:.1f}M params), heads {heads}, engine {engine}, {steps} steps, "
        f"{trainer.world_size} process(es), logs and checkpoints in {where}"
    )


def _help_formatter() -> type:
    """jsonargparse's help, with lists of "known subclasses" cut to a few names: a `nn.Module`
    argument would otherwise list every module class torch defines (hundreds of lines)."""
    from jsonargparse import DefaultHelpFormatter

    class ShortHelpFormatter(DefaultHelpFormatter):
        def _get_help_string(self, action) -> str:
            text = super()._get_help_string(action)
            head, sep, tail = text.partition(", known subclasses: ")
            if not sep:
                return text
            names = tail[:-1].split(", ") if tail.endswith(")") else tail.split(", ")
            if len(names) <= 8:
                return text
            ours = [n for n in names if n.startswith("composer_lightning.")] or names[:3]
            return f"{head}, any of {len(names)} known subclasses by class_path, e.g. {', '.join(ours[:4])})"

    return ShortHelpFormatter


def _one_line(error: BaseException) -> str:
    """A parser or constructor error as one line: for a value that matched none of a union's
    types (e.g. `class_path | None`), the errors of the types it was meant to be."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line[2:] for line in lines if line.startswith("- ") and "NoneType" not in line]
    if lines and lines[0].startswith("Does not validate against any of the Union") and causes:
        return "; ".join(causes)
    return " ".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "heads":
        return list_heads()
    # Import every registered head first so the CLI can resolve them; a broken plugin is
    # reported and the others stay usable.
    for e in registry.load_all():
        if e.error is not None:
            warnings.warn(
                f"head plugin {e.name!r} ({e.value}) failed to import: {e.error}", stacklevel=1
            )
    import lightning as L
    from jsonargparse import ArgumentError
    from lightning.pytorch.cli import LightningCLI

    from composer_lightning.callbacks.curves import Curves
    from composer_lightning.callbacks.progress import StepProgress
    from composer_lightning.callbacks.rollout import RolloutCallback
    from composer_lightning.logs import quiet_lightning

    _quiet()
    quiet_lightning()
    from composer_lightning.distributed import RankError
    from composer_lightning.errors import ConfigError, storage_error
    from composer_lightning.module import ComposerModule, OutOfSyncError
    from composer_lightning.tasks.base import ScoringError

    class ComposerCLI(LightningCLI):
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
            return super()._instantiate_trainer(config, [c for c in callbacks if c is not None])

        def before_fit(self) -> None:
            # one line instead of Lightning's model summary table
            if self.trainer.is_global_zero:
                print(run_summary(self.model, self.trainer), flush=True)

        def _run_name(self) -> str:
            files = (self.config.get(str(self.subcommand), self.config) or {}).get("config") or []
            return os.path.splitext(os.path.basename(str(files[0])))[0] if files else "run"

        def parse_arguments(self, parser, args) -> None:
            # A value the parser refuses (a wrong type, a Literal option not among its choices)
            # is a configuration error too: one line naming the key and the choices.
            try:
                super().parse_arguments(parser, args)
            except ArgumentError as exc:
                raise SystemExit(
                    f"composer_lightning: invalid configuration: {_one_line(exc)}"
                ) from None

        def _parse_ckpt_path(self) -> None:
            # A checkpoint that cannot be read (truncated, not a checkpoint) is refused here,
            # before anything is built or started, in one line naming the file.
            try:
                super()._parse_ckpt_path()
            except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
                path = self.config[self.config.subcommand].get("ckpt_path")
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
                    f"composer_lightning: invalid configuration: {_one_line(exc)}"
                ) from None

    try:
        ComposerCLI(
            ComposerModule,
            L.LightningDataModule,
            subclass_mode_data=True,
            args=argv,
            auto_configure_optimizers=False,  # ComposerModule takes its own optimizer
            trainer_defaults={
                "callbacks": [StepProgress(), Curves()],
                "enable_model_summary": False,
            },
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False, "formatter_class": _help_formatter()},
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
    return 0

"""The command line: `python -m composer_lightning fit --config <yaml>` and `... heads`."""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import sys
import warnings
from typing import Any

from composer_lightning.heads import registry
from composer_lightning.runtime.config_errors import config_error_line
from composer_lightning.runtime.overrides import is_overlay, null_overlays

USAGE = """usage: python -m composer_lightning <command> [options]

commands:
  fit        train: fit --config configs/tiny_cpu.yaml [--section.key=value ...]
  validate   the held-out figures of a config (and --ckpt_path)
  test       Lightning's test loop
  predict    Lightning's predict loop
  serve      an OpenAI-compatible endpoint that trains from its conversations
             (serve --config configs/serve_cpu.yaml)
  export     a checkpoint as a Hugging Face model directory, or its LoRA adapter
             (export --ckpt_path CKPT --out DIR [--adapter] [--dtype ...])
  heads      the registered loss heads, built-in and plugins
  report     one HTML page of a run's curves, rollouts and per-token pushes (report RUN_DIR)
  from-trl   a TRL GRPO config (the YAML `trl grpo --config` takes) as a fit config
             (from-trl grpo.yaml [--num-processes N] > run.yaml)

Each command's own options: python -m composer_lightning <command> --help"""


#: The commands that are not a Lightning subcommand: their modules, each with a `main(argv)`.
TOOLS = {
    "from-trl": "composer_lightning.from_trl",
    "export": "composer_lightning.models.export",
    "report": "composer_lightning.report.cli",
}


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
    from composer_lightning.runtime.rundir import run_dir

    params = sum(p.numel() for p in module.policy.parameters())
    trainable = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    size = f"{params / 1e6:.1f}M params"
    if trainable != params:  # LoRA: the adapters
        size += f", {trainable / 1e3:.1f}k trainable"
    heads = ", ".join(f"{h.name}×{h.weight:g}" for h in module.heads)
    engine = next(
        (type(c.engine).__name__ for c in trainer.callbacks if hasattr(c, "engine")), "none"
    )
    steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "∞"
    where = run_dir(trainer)  # not trainer.log_dir: a collective, and this runs on rank 0
    return (
        f"composer_lightning: policy {module.policy_path or type(module.policy).__name__} "
        f"({size}), heads {heads}, engine {engine}, {steps} steps, "
        f"{trainer.world_size} process(es), logs and checkpoints in {where}"
    )


def refuse_resume(trainer: Any, module: Any, ckpt_path: str | None) -> None:
    """The `ConfigError` of what a resume from `ckpt_path` cannot honour (`runtime/resume.py`), raised
    before the fit starts; nothing for a fresh run or a checkpoint that is not one file."""
    if (
        not ckpt_path
        or not os.path.isfile(ckpt_path)
        or not callable(getattr(module, "resume_differences", None))
    ):
        return
    checkpoint = trainer.strategy.checkpoint_io.load_checkpoint(ckpt_path, map_location="cpu")
    module.resume_differences(checkpoint, trainer.world_size).raise_refused()


def one_run_dir(trainer: Any, fallback_root: str) -> str | None:
    """Put every logger's files in the run's directory.

    - A logger whose `save_dir` is its class's default (W&B's ".", MLflow's "./mlruns": the
      working directory) saves under the run's root, `trainer.default_root_dir` or else
      `fallback_root`: its files, checkpoints, `rollouts.jsonl` and `curves.png` then all land
      in one directory, as they do for a TensorBoard or CSV logger.
    - A `save_dir` that differs from a given `trainer.default_root_dir` follows it: checkpoints
      follow the logger, so a YAML logger's `save_dir: runs` would otherwise keep logs and
      checkpoints in runs/ whatever `--trainer.default_root_dir` says.

    Args:
        trainer: the `trainer` section of the parsed configuration (changed in place).
        fallback_root: the run's root when `default_root_dir` is not given.

    Returns:
        The line that says which directory won over a given `save_dir`, or None.
    """
    if trainer is None:
        return None
    root = trainer.get("default_root_dir")
    loggers = trainer.get("logger")
    moved = []
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        args = getattr(logger, "init_args", None)
        if args is None or "save_dir" not in args:
            continue
        save_dir = args.save_dir
        if _is_default_save_dir(getattr(logger, "class_path", None), save_dir):
            args.save_dir = root or fallback_root
        elif root and save_dir is not None and _differ(save_dir, root):
            moved.append(str(save_dir))
            args.save_dir = root
    if not moved:
        return None
    return (
        f"trainer.default_root_dir {root!r} wins over the logger's save_dir "
        f"{', '.join(map(repr, moved))}: logs and checkpoints go under {root}"
    )


def _differ(a: Any, b: Any) -> bool:
    return os.path.abspath(str(a)) != os.path.abspath(str(b))


def _is_default_save_dir(class_path: str | None, save_dir: Any) -> bool:
    """Whether `save_dir` is the default of the logger class's `save_dir` argument."""
    module, _, name = (class_path or "").rpartition(".")
    try:
        default = (
            inspect.signature(getattr(importlib.import_module(module), name))
            .parameters["save_dir"]
            .default
        )
    except (ImportError, AttributeError, ValueError, KeyError, TypeError):
        return False
    if default is inspect.Parameter.empty:  # required (TensorBoard, CSV): always given
        return False
    if default is None:
        return save_dir is None
    return save_dir is not None and not _differ(save_dir, default)


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


def check_mode(trainer: Any, serving: bool) -> None:
    """`serve` needs a config whose rollout side is a `ServeCallback`, and `fit` one that is not.

    Raises:
        ConfigError: the subcommand and the config disagree (one line saying which to use).
    """
    from composer_lightning.runtime.errors import ConfigError

    module = sys.modules.get("composer_lightning.serve.training")
    serves = module is not None and any(
        isinstance(c, module.ServeCallback) for c in trainer.callbacks
    )
    if serving and not serves:
        raise ConfigError(
            "serve needs a config whose rollout section is composer_lightning.serve.ServeCallback "
            "(configs/serve_cpu.yaml); use fit for this one"
        )
    if serves and not serving:
        raise ConfigError(
            "this config serves an endpoint (rollout: ServeCallback): run it with "
            "`python -m composer_lightning serve --config ...`, not fit"
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "heads":
        return list_heads()
    if args and args[0] in TOOLS:  # commands of their own, each with its own `main`
        return importlib.import_module(TOOLS[args[0]]).main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    serving = args[0] == "serve"  # fit, with the endpoint as the rollout side
    if serving:
        args = ["fit", *args[1:]]
    # a `null` nested in class specs, which jsonargparse cannot take on the command line
    args = null_overlays(args)
    if argv is None:
        sys.argv[1:] = args
    else:
        argv = args
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
    from lightning.pytorch.utilities import rank_zero_only

    from composer_lightning.callbacks.curves import Curves
    from composer_lightning.callbacks.progress import StepProgress
    from composer_lightning.report.callback import with_run_report
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.runtime.logs import quiet_lightning

    _quiet()
    quiet_lightning()
    from composer_lightning.runtime.distributed import RankError
    from composer_lightning.runtime.errors import ConfigError, storage_error
    from composer_lightning.tasks.base import ScoringError
    from composer_lightning.training.module import ComposerModule, OutOfSyncError

    class ComposerCLI(LightningCLI):
        def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # static there
            # The parser of the subcommand being run only: LightningCLI builds one for each of
            # fit, validate, test and predict (≈ 0.2 s each, every class signature read), and
            # a run uses one. An unknown subcommand gets all four, for the parser's error.
            every = LightningCLI.subcommands()
            return {args[0]: every[args[0]]} if args and args[0] in every else every

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
            check_mode(self.trainer, serving)
            # one line instead of Lightning's model summary table
            if self.trainer.is_global_zero:
                print(run_summary(self.model, self.trainer), flush=True)

        def before_instantiate_classes(self) -> None:
            section = self.config.get(str(self.subcommand)) if self.subcommand else self.config
            say = one_run_dir(
                section.get("trainer") if section is not None else None,
                os.path.join("runs", self._run_name()),
            )
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
    finally:
        _release_process_group()
    return 0


def _release_process_group() -> None:
    """Destroy the run's process group (local under gloo: no collective) while Python still
    runs, whatever ended the run. Left to the interpreter's exit, its C++ threads were torn
    down in static-destructor order, and a rank whose peer's node had already gone (a
    scheduler's SIGTERM to one node: both stop and save, then exit) once aborted there with
    "terminate called without an active exception" (exit -6 instead of 128 + the signal). An
    in-process vLLM engine's groups go first, through vLLM's own teardown: destroyed under it,
    its exit hook raised on a group that no longer existed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None:  # an in-process vLLM engine's groups, made over ours: first
        vllm_groups.destroy_model_parallel()  # (its exit hook does the same, and no more once
        vllm_groups.destroy_distributed_environment()  # they are gone)
    if dist.is_initialized():
        dist.destroy_process_group()

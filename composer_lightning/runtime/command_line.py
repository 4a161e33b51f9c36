"""What the command line does around Lightning's CLI (`composer_lightning.lightning_cli`): the
one-line run summary, the checks made before a fit starts (a resume that cannot be honoured, a
config run by the wrong command), one run directory for every logger, a short `--help`, quiet
warnings, and the process group released while Python still runs."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from typing import Any


def quiet_warnings() -> None:
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
    """`composer_lightning: <policy> (N params), heads ..., engine ..., steps ..., malloc ...,
    logs in ...`"""
    from composer_lightning.runtime.allocator import malloc_in_use
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
        f"{trainer.world_size} process(es), {malloc_in_use()}, logs and checkpoints in {where}"
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


def help_formatter() -> type:
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


def release_process_group() -> None:
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

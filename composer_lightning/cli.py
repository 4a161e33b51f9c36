"""The command line: `python -m composer_lightning fit --config <yaml>` and `... heads`."""

from __future__ import annotations

import importlib
import sys
import warnings

from composer_lightning.heads import registry
from composer_lightning.runtime.allocator import reexec_with_tcmalloc
from composer_lightning.runtime.overrides import null_overlays

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "heads":
        return list_heads()
    if args and args[0] in TOOLS:  # commands of their own, each with its own `main`
        return importlib.import_module(TOOLS[args[0]]).main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv is None:  # the command line: its process may take tcmalloc (runtime/allocator.py)
        reexec_with_tcmalloc()
    serving = args[0] == "serve"  # fit, with the endpoint as the rollout side
    if serving:
        args = ["fit", *args[1:]]
    # a `null` nested in class specs, which jsonargparse cannot take on the command line
    args = null_overlays(args)
    if argv is None:
        sys.argv[1:] = args
    else:
        argv = args
    load_head_plugins()
    from composer_lightning.lightning_cli import run  # imports Lightning: its loggers exist
    from composer_lightning.runtime.command_line import quiet_warnings
    from composer_lightning.runtime.logs import quiet_lightning

    quiet_warnings()
    quiet_lightning()
    run(argv, serving)
    return 0


def load_head_plugins() -> None:
    """Import every registered head, so the CLI can resolve them: a broken plugin is reported
    by name and the others stay usable."""
    for e in registry.load_all():
        if e.error is not None:
            warnings.warn(
                f"head plugin {e.name!r} ({e.value}) failed to import: {e.error}", stacklevel=1
            )

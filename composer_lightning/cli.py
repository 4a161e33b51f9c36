"""The command line: `python -m composer_lightning fit --config <yaml>` and `... heads`."""

from __future__ import annotations

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
            print(f"{e.name:<{width}}  {e.class_path}  {doc[0] if doc else ''}".rstrip(), file=stream)
        else:
            print(f"{e.name:<{width}}  {e.class_path}  FAILED TO IMPORT: {e.error}", file=stream)
    return 0


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
            warnings.warn(f"head plugin {e.name!r} ({e.value}) failed to import: {e.error}", stacklevel=1)
    import lightning as L
    from jsonargparse import ArgumentError
    from lightning.pytorch.cli import LightningCLI

    from composer_lightning.callbacks.rollout import RolloutCallback
    from composer_lightning.distributed import RankError
    from composer_lightning.errors import ConfigError
    from composer_lightning.module import ComposerModule, OutOfSyncError
    from composer_lightning.tasks.base import ScoringError

    class ComposerCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            # The rollout side is its own section (`rollout:`, `--rollout.group_size=8`,
            # `--rollout.engine.init_args.seed=1`), not an entry of trainer.callbacks; configs
            # whose data module yields rollout batches itself leave it out.
            parser.add_lightning_class_args(RolloutCallback, "rollout", subclass_mode=True,
                                            required=False)

        def _instantiate_trainer(self, config, callbacks):
            return super()._instantiate_trainer(config, [c for c in callbacks if c is not None])

        def parse_arguments(self, parser, args) -> None:
            # A value the parser refuses (a wrong type, a Literal option not among its choices)
            # is a configuration error too: one line naming the key and the choices.
            try:
                super().parse_arguments(parser, args)
            except ArgumentError as exc:
                raise SystemExit(f"composer_lightning: invalid configuration: {_one_line(exc)}") from None

        def instantiate_classes(self) -> None:
            # Errors while building the configured objects are configuration errors: say what
            # is wrong in one line instead of a traceback.
            try:
                super().instantiate_classes()
            except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
                raise SystemExit(f"composer_lightning: invalid configuration: {_one_line(exc)}") from None

    try:
        ComposerCLI(ComposerModule, L.LightningDataModule, subclass_mode_data=True, args=argv,
                    save_config_kwargs={"overwrite": True}, parser_kwargs={"exit_on_error": False})
    except ConfigError as exc:  # parts that disagree, found at setup, before any engine starts
        raise SystemExit(f"composer_lightning: invalid configuration: {exc}") from None
    except (RankError, OutOfSyncError, ScoringError) as exc:  # the run's own stops: one line
        raise SystemExit(f"composer_lightning: {type(exc).__name__}: {exc}") from None
    return 0

"""Old import paths of modules and names that moved when the package was laid out by role.

A configuration or script written before the move (`composer_lightning.callbacks.rollout.
RolloutCallback`, `from composer_lightning.module import ComposerModule`, a checkpoint whose
pickled state names an old module) still imports: the old module name is the new module
itself, registered under both names, with one `FutureWarning` line naming the new path. Names
that left a module that still exists (`tasks.base.VerifierScore`) are found through that
module's `__getattr__`, with the same line. Every entry is here, in one table each; the
package's `__init__` installs the finder before anything else is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module → new module (the package root's flat modules went into rooms by role).
MOVED_MODULES: dict[str, str] = {
    f"composer_lightning.{old}": f"composer_lightning.{new}"
    for old, new in {
        "accumulate": "training.accumulate",
        "atomic": "runtime.atomic",
        "batch": "protocols.batch",
        "callbacks.generation": "rollout.generation",
        "callbacks.rollout": "rollout.callback",
        "canary": "training.canary",
        "checkpoint": "training.checkpoint",
        "checkpoint_io": "runtime.checkpoint_io",
        "datamodules.packing": "rollout.packing",
        "dispatch": "rollout.dispatch",
        "distributed": "runtime.distributed",
        "engines.weights": "models.weights",
        "episodes": "rollout.episodes",
        "errors": "runtime.errors",
        "export": "models.export",
        "forward": "training.forward",
        "inputs": "runtime.inputs",
        "logs": "runtime.logs",
        "microbatch": "training.microbatch",
        "mixer": "training.mixer",
        "models.build_tiny": "assets.build_tiny",
        "models.build_tiny_tool": "assets.build_tiny_tool",
        "module": "training.module",
        "objective": "training.objective",
        "resume": "runtime.resume",
        "step": "protocols.step",
        "steplog": "training.steplog",
        "tasks.calls": "runtime.calls",
        "topk_targets": "training.topk_targets",
        "validation": "rollout.validation",
    }.items()
}

#: (module that still exists, name that left it) → the module that holds the name now: the
#: names a configuration writes (providers, tasks).
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("composer_lightning.tasks.base", "VerifierScore"): "composer_lightning.tasks.verifiers",
    ("composer_lightning.tasks.base", "VerifierHint"): "composer_lightning.tasks.verifiers",
    ("composer_lightning.tasks.base", "FunctionHint"): "composer_lightning.tasks.hints",
    ("composer_lightning.tasks.base", "ToolErrorHint"): "composer_lightning.tasks.hints",
    ("composer_lightning.envs.openenv_env", "OpenEnvTask"): "composer_lightning.tasks.openenv",
    ("composer_lightning.serve.training", "ServeDataModule"): "composer_lightning.serve.data",
}


def _moved(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} is now {new}: the old path still imports but will be removed; update the "
        "import or class_path",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


class _Alias(importlib.abc.Loader):
    """Loads an old module name as the new module object itself."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _moved(spec.name, self.new, 2)  # importlib's own frames are skipped
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old name of a moved module (`MOVED_MODULES`)."""

    def find_spec(self, fullname: str, path: object, target: object = None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on `sys.meta_path` once (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def moved_attribute(module: str, name: str) -> object:
    """A module's `__getattr__` for the names that left it (`MOVED_NAMES`).

    Raises:
        AttributeError: `name` never was in `module`.
    """
    new = MOVED_NAMES.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _moved(f"{module}.{name}", f"{new}.{name}", 3)  # past the module's __getattr__
    return getattr(importlib.import_module(new), name)

"""composer_lightning: RL post-training of language models on PyTorch Lightning by composing
plug-in loss heads (Dr. GRPO, OPD teacher advantage, SDPO, replay DPO, KL).

The package is laid out by role, one room (subpackage) per role; each room's docstring says what
it owns and what it may import. Imports point down `LAYERS` only (a room imports rooms before it
in the tuple, never after), and no module imports itself back through others
(`tests/test_layout.py` holds both). The package root holds the entry points (`cli.py`, the
Lightning CLI it runs in `lightning_cli.py`, `__main__.py`, `from_trl.py`) and the public names
below.
"""

from composer_lightning.runtime.moved import install as _install_moved_paths

_install_moved_paths()  # old import paths (before the layout by role) still import

from composer_lightning.protocols.batch import DPOPairs, RolloutBatch  # noqa: E402

__version__ = "0.1.0"

#: The rooms, lowest first: each may import only the rooms before it (and itself).
LAYERS: tuple[str, ...] = (
    "functional",  # pure math: tensors in, tensors out
    "runtime",  # process plumbing and run state: errors, rank agreement, atomic writes, resume
    "models",  # loading policies: hub ids, LoRA, sharding, weights under HF names, export
    "engines",  # inference engines: generate from token ids, take weight pushes
    "chat",  # chat templates on token ids, and where the hint goes
    "envs",  # environments of multi-turn episodes
    "tasks",  # problems, verifiers, score and hint providers
    "protocols",  # the typed hand-offs: RolloutBatch, and what a head reads
    "heads",  # the loss heads and their registry
    "callbacks",  # Lightning callbacks of general use: progress, stop, checkpoints, samples
    "report",  # the run report: a run's files drawn as one HTML page, and what it reads
    "training",  # the step: the module, its forwards, micro-batches, mixing, the canary
    "rollout",  # generation, episodes, dispatch, validation: the rollout callback
    "datamodules",  # prompt streams and recorded traces
    "serve",  # the OpenAI-compatible endpoint that trains on what it serves
    "assets",  # the shipped tiny policies and their builders
)

__all__ = ["LAYERS", "RolloutBatch", "DPOPairs", "ComposerModule", "__version__"]


def __getattr__(name: str):  # lazy: importing the package must not import Lightning
    if name == "ComposerModule":
        from composer_lightning.training.module import ComposerModule

        return ComposerModule
    raise AttributeError(name)

"""composer_lightning: RL post-training of language models on PyTorch Lightning by composing
plug-in loss heads (Dr. GRPO, OPD teacher advantage, SDPO, replay DPO, KL)."""

from composer_lightning.batch import DPOPairs, RolloutBatch

__version__ = "0.1.0"

__all__ = ["RolloutBatch", "DPOPairs", "ComposerModule", "__version__"]


def __getattr__(name: str):  # lazy: importing the package must not import Lightning
    if name == "ComposerModule":
        from composer_lightning.module import ComposerModule

        return ComposerModule
    raise AttributeError(name)

"""`ServeDataModule`: the step indices of `serve` mode (its samples come from the store)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from composer_lightning.protocols.prompts import PromptBatch


class _Steps(IterableDataset):
    def __init__(self, dm: ServeDataModule):
        self.dm = dm

    def __iter__(self) -> Iterator[PromptBatch]:
        i = self.dm.consumed
        while True:
            yield PromptBatch(i, [], [])
            i += 1


class ServeDataModule(L.LightningDataModule):
    """Step indices for serving mode: each step's samples are the judged turns the
    `ServeCallback` takes from its store when the step starts (never prefetched).

    Args:
        tokenizer: the policy's tokenizer directory or hub id; None: the policy's directory.
    """

    def __init__(self, tokenizer: str | None = None):
        super().__init__()
        self.tokenizer_path = tokenizer
        self.consumed = 0
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from composer_lightning.models.hub import TOKENIZER_FILE, resolve_model

            path = self.tokenizer_path
            if path is None:
                module = getattr(getattr(self, "trainer", None), "lightning_module", None)
                path = getattr(module, "policy_path", None)
            if path is None:
                raise ValueError("ServeDataModule needs a tokenizer directory or the policy's")
            self._tokenizer = AutoTokenizer.from_pretrained(
                resolve_model(path, what="ServeDataModule tokenizer", require=TOKENIZER_FILE)
            )
        return self._tokenizer

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Steps(self), batch_size=None, collate_fn=lambda b: b)

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed"])

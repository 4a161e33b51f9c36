"""The policy's small files (configs, tokenizer, chat template) kept inside a checkpoint.

A checkpoint holds the policy's weights; with these files beside them it is self-contained:
`export` writes a complete HF model directory from it, and `ComposerModule.load_from_checkpoint`
rebuilds the policy when the directory it was trained from is gone (another machine, another
working directory, an empty hub cache). Weights are never stored here. The files are kept
zlib-compressed: the tiny policy's take 5 KB (24 KB uncompressed); a real
tokenizer is a few MB (Qwen2.5's tokenizer.json is ≈ 7 MB before compression).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

#: The files kept, when the policy's directory has them. `vocab.json`, `merges.txt` and
#: `tokenizer.model` only without a `tokenizer.json` (which holds the same vocabulary).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model")


def read_model_files(directory: str) -> dict[str, bytes]:
    """The small files of the HF model in `directory`, by name, zlib-compressed."""
    names = list(MODEL_FILES)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        names += SLOW_TOKENIZER_FILES
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = zlib.compress(f.read(), 6)
    return out


def write_model_files(files: dict[str, bytes], directory: str) -> list[str]:
    """Write what `read_model_files` returned into `directory`; the names written."""
    os.makedirs(directory, exist_ok=True)
    for name, data in files.items():
        if os.path.basename(name) != name:  # only plain names are ever stored
            raise ValueError(f"stored model file name {name!r} is not a plain file name")
        with open(os.path.join(directory, name), "wb") as f:
            f.write(zlib.decompress(data))
    return sorted(files)


def checkpoint_meta(path: str) -> dict[str, Any]:
    """The checkpoint at `path` without needing its weights in memory: a single file is
    memory-mapped; of a sharded directory (torch.distributed.checkpoint, as
    ModelParallelStrategy writes it) only `meta.pt`, which holds everything but the tensors
    of weights and optimizer, is read."""
    import torch

    if os.path.isdir(path):
        meta = os.path.join(path, "meta.pt")
        if not os.path.isfile(meta):
            raise FileNotFoundError(
                f"checkpoint directory {path!r} has no meta.pt; expected a Lightning checkpoint "
                "file or a sharded checkpoint directory written by ModelParallelStrategy"
            )
        return torch.load(meta, map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def stored_model_files(checkpoint: dict[str, Any]) -> dict[str, bytes]:
    """The policy files a checkpoint holds (empty for one written without them)."""
    return (checkpoint.get("composer") or {}).get("policy_files") or {}


#: The checkpoint `ComposerModule.load_from_checkpoint` is reading, while it builds the module.
loading_checkpoint: ContextVar[str | None] = ContextVar("loading_checkpoint", default=None)


@contextmanager
def reading_checkpoint(path: Any) -> Iterator[None]:
    """Let the module being built from `path` fall back on the files stored in it."""
    token = loading_checkpoint.set(
        os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    )
    try:
        yield
    finally:
        loading_checkpoint.reset(token)

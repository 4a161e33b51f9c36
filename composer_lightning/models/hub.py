"""One place where a model spec becomes a local directory: a local path, a Hugging Face hub id,
or a GGUF file (`models/gguf.py`: dequantised once into a cache directory).

A spec is what a user writes for `model.policy`, `model.reference`, `model.teacher`, an
engine's `model_path`, a tokenizer: a local directory (`./out/policy`, `/models/qwen`), or a
hub id (`Qwen/Qwen2.5-0.5B-Instruct`), optionally pinned to a revision as `id@revision` (a
branch, tag or commit hash; the same revision transformers' `from_pretrained(revision=...)` and
vLLM's `--revision` take). An existing local directory always wins over a hub id of the same
name, as in transformers.

A hub id is fetched once with `huggingface_hub.snapshot_download` into the usual cache and its
snapshot directory is what the rest of the library sees, so the engines and the tokenizer read
the very files the trainer loaded. The environment is read when a spec is resolved, not when
`huggingface_hub` was imported: `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`) reads the
cache only; `HF_HUB_CACHE`, else `HF_HOME/hub`, names the cache.
"""

from __future__ import annotations

import os
import re

from composer_lightning.models.gguf import is_gguf_spec, resolve_gguf

#: What a model snapshot needs: configs, safetensors weights, tokenizer files, chat templates.
#: Other weight formats in the same repository (`.bin`, `.pth`, `.gguf`, ONNX) are not fetched.
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]

#: What a tokenizer directory holds (`resolve_model(..., require=TOKENIZER_FILE)`).
TOKENIZER_FILE = "tokenizer_config.json"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def split_revision(spec: str) -> tuple[str, str | None]:
    """`("org/name", "rev")` of `"org/name@rev"`; `(spec, None)` without an `@`."""
    name, sep, revision = spec.partition("@")
    return (name, revision or None) if sep else (spec, None)


def looks_like_hub_id(spec: str) -> bool:
    """`name` or `org/name` (with an optional `@revision`): the shape of a hub repository id.
    Paths that start with `.`, `/` or `~`, or have more than one `/`, are local."""
    name, _ = split_revision(spec)
    return bool(_HUB_ID.match(name)) and ".." not in name and "--" not in name


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) as the environment says now."""
    return _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> str:
    """The hub cache the environment names now: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
    `~/.cache/huggingface/hub` (`huggingface_hub.constants` reads these at import time)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface",
        )
        cache = os.path.join(home, "hub")
    return os.path.abspath(os.path.expanduser(os.path.expandvars(cache)))


def resolve_model(
    spec: str, revision: str | None = None, what: str = "model", require: str = "config.json"
) -> str:
    """The absolute local directory of `spec`: the directory itself, or the hub snapshot of it.

    Args:
        spec: a local directory, `org/name` or `org/name@revision`, or a GGUF file (a path
            ending in `.gguf`, or `pkg:<package>/<file>.gguf`; `models/gguf.py`).
        revision: the hub revision (branch, tag or commit); wins over an `@revision` in `spec`.
        what: what the spec is, for error messages (`model.policy`, `HFEngine model_path`).
        require: the file the directory must hold (`tokenizer_config.json` for a tokenizer).

    Returns:
        An absolute path to a directory holding `require`.

    Raises:
        FileNotFoundError: one line naming the spec: a missing local directory, a directory
            without `config.json`, or a hub id neither cached (offline) nor fetchable.
        ValueError: one line naming a GGUF file that cannot be read as a causal LM.
    """
    if is_gguf_spec(spec):
        return resolve_gguf(spec, what)
    if os.path.isdir(spec) or not looks_like_hub_id(spec):
        path = os.path.abspath(os.path.expanduser(spec))
        if not os.path.isfile(os.path.join(path, require)):
            kind = "model directory" if require == "config.json" else "directory"
            raise FileNotFoundError(
                f"{what}: {kind} {spec!r} not found or has no {require}; expected a local HF "
                "model directory or a hub id (org/name[@revision])"
            )
        return path
    repo_id, pinned = split_revision(spec)
    return _snapshot(repo_id, revision or pinned, what, require)


def _snapshot(repo_id: str, revision: str | None, what: str, require: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
    )

    cache, offline = hub_cache_dir(), hub_offline()
    at = f"@{revision}" if revision else ""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=SNAPSHOT_FILES,
        )
    except IncompleteSnapshotError:
        raise FileNotFoundError(
            f"{what}: the cached snapshot of {repo_id}{at} in {cache} is incomplete (an "
            f"interrupted download?); run `hf download {repo_id}` with network access"
        ) from None
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise FileNotFoundError(
            f"{what}: {repo_id}{at} is not a local directory, and not in the hub cache {cache} "
            f"({how}); download it first (`hf download {repo_id}`) or give a local directory"
        ) from None
    except (HfHubHTTPError, ValueError, OSError) as exc:  # unknown repo or revision, no access
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(
            f"{what}: cannot fetch {repo_id}{at} from the hub into {cache}: {reason}"
        ) from None
    if not os.path.isfile(os.path.join(path, require)):
        raise FileNotFoundError(f"{what}: the snapshot of {repo_id}{at} in {path} has no {require}")
    return os.path.abspath(path)

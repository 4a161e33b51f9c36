"""A GGUF file's tokenizer flags, carried into the tokenizer transformers builds from the file.

transformers (5.19) builds a GGUF file's tokenizer from its vocabulary and special token ids but
drops the flags that say how text is encoded: `tokenizer.ggml.add_bos_token` (Gemma 3's is true;
its converted tokenizer added no BOS, and Gemma without its BOS writes nonsense),
`add_eos_token`, `add_space_prefix` (whether a sentencepiece vocabulary spells the first word
with a leading `▁`). Here every tokenizer key of the file is read (`read_tokenizer_keys`), what
the file says is set on the tokenizer (`apply_tokenizer_keys`), and `tokenizer_mismatches`
lists where a tokenizer encodes otherwise than the file says; the conversion (`models/gguf.py`)
checks the directory it wrote with it, reloaded as `AutoTokenizer` reads it.

What each key becomes (a key the file lacks leaves transformers' tokenizer as it is):
| key (`tokenizer.ggml.`) | in the converted directory |
|---|---|
| `add_bos_token`, `add_eos_token` | the tokenizer's flags and post-processor: `tokenizer(text)` adds them |
| `bos/eos/unknown/padding/seperator/mask_token_id` | the special tokens of those names |
| `eot_token_id`, `eom_token_id` | end-of-generation ids in `generation_config.json` (llama.cpp stops there too) |
| `add_space_prefix` | sentencepiece (`model = llama`) only, as llama.cpp reads it: a leading `▁` |
| `tokenizer.chat_template` | the chat template |
| `add_sep_token` = true | refused: an encoder's flag (BERT), no causal LM's prompt ends in SEP |
The vocabulary, scores, merges, token types and pre-tokenizer are transformers' to read; llama.cpp
reads `remove_extra_whitespaces` for unigram (T5) vocabularies only, and code-infill ids name
tokens the vocabulary already holds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

#: GGUF value types (the format's `gguf_type`): struct codes of the fixed-size ones.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9

#: The special tokens a file may name, by key, and their names on an HF tokenizer.
SPECIAL_IDS = {
    "bos_token_id": "bos_token",
    "eos_token_id": "eos_token",
    "unknown_token_id": "unk_token",
    "padding_token_id": "pad_token",
    "seperator_token_id": "sep_token",  # llama.cpp's spelling
    "mask_token_id": "mask_token",
}


def read_tokenizer_keys(path: str) -> dict[str, Any]:
    """The file's scalar `tokenizer.*` keys (prefix stripped: `ggml.add_bos_token`,
    `chat_template`) and `general.architecture`; arrays (the vocabulary) are skipped unread.

    Raises:
        ValueError: not a little-endian GGUF file of version 2 or 3.
    """
    keys: dict[str, Any] = {}
    with open(path, "rb") as f:
        magic, version = f.read(4), _unpack(f, "I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF file of version 2 or 3 (magic {magic!r})")
        _unpack(f, "Q")  # tensor count
        for _ in range(_unpack(f, "Q")):
            name = _string(f)
            kind = _unpack(f, "I")
            wanted = name.startswith("tokenizer.") or name == "general.architecture"
            value = _value(f, kind, keep=wanted)
            if wanted and kind != _ARRAY:
                keys[name.removeprefix("tokenizer.")] = value
    return keys


def _unpack(f: BinaryIO, code: str) -> Any:
    size = struct.calcsize(code)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("GGUF metadata ends early (a truncated file?)")
    return struct.unpack("<" + code, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_unpack(f, "Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        if keep:
            return _string(f)
        f.seek(_unpack(f, "Q"), 1)
        return None
    if kind == _ARRAY:  # skipped: strings walked by their lengths, numbers in one seek
        item, count = _unpack(f, "I"), _unpack(f, "Q")
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _value(f, item, keep=False)
        return None
    raise ValueError(f"GGUF metadata holds an unknown value type {kind}")


@dataclass(frozen=True)
class TokenizerKeys:
    """What a GGUF file says about encoding text, as `read_tokenizer_keys` found it (None: the
    file does not say)."""

    model: str | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    add_sep_token: bool | None = None
    add_space_prefix: bool | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # {"bos_token": 2, ...}
    end_ids: tuple[int, ...] = ()  # end-of-turn / end-of-message ids
    chat_template: str | None = None

    @classmethod
    def of(cls, keys: dict[str, Any]) -> TokenizerKeys:
        """The keys `read_tokenizer_keys` returned, by meaning."""
        ggml = {k.removeprefix("ggml."): v for k, v in keys.items() if k.startswith("ggml.")}
        flag = lambda name: None if ggml.get(name) is None else bool(ggml[name])  # noqa: E731
        return cls(
            model=ggml.get("model"),
            add_bos_token=flag("add_bos_token"),
            add_eos_token=flag("add_eos_token"),
            add_sep_token=flag("add_sep_token"),
            add_space_prefix=flag("add_space_prefix"),
            special_ids={
                name: int(ggml[key])
                for key, name in SPECIAL_IDS.items()
                if ggml.get(key) is not None
            },
            end_ids=tuple(int(ggml[k]) for k in ("eot_token_id", "eom_token_id") if k in ggml),
            chat_template=keys.get("chat_template"),
        )

    @property
    def sentencepiece(self) -> bool:
        """A sentencepiece vocabulary, the only kind `add_space_prefix` applies to here (as in
        llama.cpp; unigram files are not causal LMs transformers reads)."""
        return self.model == "llama"


def apply_tokenizer_keys(tokenizer: Any, keys: TokenizerKeys, what: str = "model") -> None:
    """Set on `tokenizer` (a transformers fast tokenizer built from the file) what `keys` say.

    Raises:
        ValueError: the file sets `add_sep_token` (one line naming it).
    """
    if keys.add_sep_token:
        raise ValueError(
            f"{what}: the GGUF file sets tokenizer.ggml.add_sep_token (every encoded text ends "
            "in a separator, an encoder's convention): expected a causal LM's tokenizer"
        )
    vocab = tokenizer.convert_ids_to_tokens(list(keys.special_ids.values()))
    for (name, token_id), token in zip(keys.special_ids.items(), vocab, strict=True):
        if token is not None and getattr(tokenizer, f"{name}_id", None) != token_id:
            setattr(tokenizer, name, token)
    if keys.chat_template is not None:
        tokenizer.chat_template = keys.chat_template
    if keys.add_space_prefix is not None and keys.sentencepiece:
        _set_space_prefix(tokenizer, keys.add_space_prefix)
    for name in ("add_bos_token", "add_eos_token"):
        value = getattr(keys, name)
        if value is not None:
            # the post-processor, rebuilt by the setter, is what tokenizer.json keeps (transformers
            # 5 saves no add_bos_token: a reloaded tokenizer reports False and adds the BOS)
            setattr(tokenizer, name, value)


def _set_space_prefix(tokenizer: Any, on: bool) -> None:
    """Spell the first word with a leading `▁` (or not), in whichever of the two ways the
    tokenizer spells spaces: a `Metaspace` pre-tokenizer (Llama's) or a normalizer that
    replaces spaces (Gemma's, Phi-3's). Decoding strips that one space again, as llama.cpp's
    detokenizer does."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace":
        pre["prepend_scheme"] = "first" if on else "never"
    else:
        parts = _flat(spec.get("normalizer"))
        parts = [p for p in parts if not (p["type"] == "Prepend" and p["prepend"] == "▁")]
        if on:
            parts.insert(0, {"type": "Prepend", "prepend": "▁"})
        spec["normalizer"] = {"type": "Sequence", "normalizers": parts} if parts else None
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    decoders = [d for d in _flat(spec.get("decoder"), "decoders") if d != strip]
    spec["decoder"] = {"type": "Sequence", "decoders": decoders + ([strip] if on else [])}
    edited, backend = Tokenizer.from_str(json.dumps(spec)), tokenizer.backend_tokenizer
    backend.normalizer, backend.pre_tokenizer = edited.normalizer, edited.pre_tokenizer
    backend.decoder = edited.decoder
    tokenizer.add_prefix_space = on
    tokenizer.init_kwargs["add_prefix_space"] = on


def _flat(component: dict[str, Any] | None, key: str = "normalizers") -> list[dict[str, Any]]:
    """The parts of a tokenizers component as a list (a Sequence's items, one, or none)."""
    if not component:
        return []
    return list(component[key]) if component.get("type") == "Sequence" else [component]


def tokenizer_mismatches(tokenizer: Any, keys: TokenizerKeys) -> list[str]:
    """Where `tokenizer` encodes otherwise than `keys` say, one phrase each (empty: none)."""
    out = []
    for name, token_id in keys.special_ids.items():
        if getattr(tokenizer, f"{name}_id", None) != token_id:
            out.append(f"{name} id {getattr(tokenizer, f'{name}_id', None)}, not {token_id}")
    ids = list(tokenizer("a b")["input_ids"])
    bos, eos = keys.special_ids.get("bos_token"), keys.special_ids.get("eos_token")
    for name, value, special_id, index in (
        ("add_bos_token", keys.add_bos_token, bos, 0),
        ("add_eos_token", keys.add_eos_token, eos, -1),
    ):
        if value is not None and special_id is not None and (ids[index] == special_id) != value:
            out.append(f"{name} {value} but tokenizer('a b') gives {ids}")
    if keys.add_space_prefix is not None and keys.sentencepiece:
        first = tokenizer.convert_ids_to_tokens(
            tokenizer("a", add_special_tokens=False)["input_ids"]
        )
        if first[0].startswith("▁") != keys.add_space_prefix:
            out.append(f"add_space_prefix {keys.add_space_prefix} but 'a' encodes as {first}")
    if keys.chat_template is not None and tokenizer.chat_template != keys.chat_template:
        out.append("the chat template differs from the file's")
    return out

"""Every string a client gives a chat template is rendered as literal text: the tokenizer's
special tokens (`<|im_start|>`, `<|eot|>`, ...) come only from the template itself.

A client that writes `...<|eot|><|assistant|>7` in a message, a tool name, a description, a
parameter schema or a call's arguments must not forge a turn in the prompt (which is training
data in `serve`). The strings are located by construction, not searched for in the rendered text
(a search finds the template's own copy of the same string as readily as the client's):

1. every occurrence of a special token's string inside any string of the messages and the tools
   (values and keys, at any depth) is replaced by a placeholder, private-use characters that
   occur nowhere else, before the template renders them;
2. the template renders that chat once; the special tokens in that text are the template's own;
3. the text is tokenised as usual, and each stretch between two of the template's special tokens
   that holds a placeholder is tokenised again with the placeholders put back, as plain text
   (special tokens not parsed: `literal_ids`).

A chat whose strings hold no special token's string is exactly `tokenizer(text)`. A message's
role is the one string a template may make control tokens of (`<|{{ role }}|>`): it must be a
role the template knows (`serve` accepts OpenAI's roles only). The template
must render a placeholder as it renders the string it replaces (it does unless it tests for the
very string, or escapes non-ASCII text): the text with the placeholders put back is checked to be
the template's rendering of the real chat, else a ValueError says which strings.

Special tokens are the tokenizer's added tokens marked special. Other added tokens (Qwen's
`<tool_call>`, `<think>`) are vocabulary the model writes in its own text, tokenised the same
wherever the text comes from. Simplified: a stretch tokenised again is tokenised as a text of its
own, so a pre-tokenizer that treats a text's start apart (SentencePiece's "prepend a space to the
first word") sees one more start; only chats whose strings hold special tokens' strings meet it.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]
#: renders (messages, tools) with the chat template to text
Render = Callable[[list[Message], list[dict[str, Any]] | None], str]

_PRIVATE_USE = range(0xE000, 0xF900)  # Unicode's private-use area: no tokenizer's controls
_literal_backends: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def special_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into its special (control) tokens wherever they appear."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [str(t.content) for t in decoder.values() if getattr(t, "special", True)]


def literal_ids(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids of `text` as plain text: a special token's string in it is tokenised as the
    characters it is (`split_special_tokens`), never as the token.

    On a tokenizer with a Rust backend this encodes with a private copy of the backend set to
    split special tokens, so the shared tokenizer's setting is never changed: that setting is
    one flag, read by every encode, and a chat rendered on another thread meanwhile (the trainer
    beside `serve`'s endpoint) would otherwise parse client text, or not parse the template's
    own tokens, as the flag happened to be."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_special_tokens"):
        out = tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
        return list(out["input_ids"])
    cached = _literal_backends.get(tokenizer)
    if cached is None or cached[0] is not backend:
        copy = backend.from_str(backend.to_str())  # a static method: a new backend
        copy.encode_special_tokens = True
        cached = (backend, copy)
        _literal_backends[tokenizer] = cached
    return list(cached[1].encode(text, add_special_tokens=add_special_tokens).ids)


def render_literal(
    tokenizer: Any,
    render: Render,
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """The ids of `render(messages, tools)`, every string of `messages` and `tools` as literal
    text (module docstring).

    Raises:
        ValueError: the template renders a string holding a special token's string otherwise
            than the placeholder standing for it, so it cannot be kept as plain text.
    """
    text = render(messages, tools)
    specials = special_strings(tokenizer)
    pattern = _alternation(tuple(specials))
    strings = list(_strings([messages, tools]))
    if pattern is None or not any(pattern.search(s) for s in strings):
        return _plain(tokenizer, text)
    mark = _free_mark(text, strings)
    index = {s: i for i, s in enumerate(specials)}
    hide = lambda s: pattern.sub(lambda m: f"{mark}{index[m.group(0)]}{mark}", s)  # noqa: E731
    marked = render(_mapped(messages, hide), _mapped(tools, hide))
    placeholder = re.compile(f"{mark}(\\d+){mark}")
    show = lambda s: placeholder.sub(lambda m: specials[int(m.group(1))], s)  # noqa: E731
    if show(marked) != text:
        found = sorted({m.group(0) for s in strings for m in pattern.finditer(s)})
        raise ValueError(
            f"the chat template renders a text holding the special token(s) {found} otherwise "
            "than it renders other text, so they cannot be kept as plain text: remove them"
        )
    return _tokenize_around(tokenizer, marked, mark, show)


def _plain(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tokenize_around(
    tokenizer: Any, marked: str, mark: str, show: Callable[[str], str]
) -> list[int]:
    """`marked` tokenised as usual (its special tokens are all the template's), each stretch
    between two special tokens that holds a placeholder tokenised again as plain text."""
    enc = tokenizer(marked, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {i for i, t in decoder.items() if getattr(t, "special", True)}
    out: list[int] = []
    run: list[int] = []  # the non-special ids since the last special token
    start = 0  # where the text of `run` begins

    def flush(end: int) -> None:
        piece = marked[start:end]
        out.extend(literal_ids(tokenizer, show(piece)) if mark in piece else run)

    for token, (a, b) in zip(ids, offsets, strict=True):
        if token in special:
            flush(a)
            out.append(token)
            run, start = [], b
        else:
            run.append(token)
    flush(len(marked))
    return out


@functools.lru_cache(maxsize=16)
def _alternation(strings: tuple[str, ...]) -> re.Pattern[str] | None:
    """A pattern matching any of `strings`, the longest first where several begin at one place
    (as the tokenizer matches its added tokens)."""
    if not strings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(set(strings), key=len, reverse=True)))


def _strings(value: Any):
    """Every string in `value` (dict keys too), at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _mapped(value: Any, f: Callable[[str], str]) -> Any:
    """`value` with `f` applied to every string in it (dict keys too), at any depth."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {_mapped(k, f): _mapped(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, f) for v in value)
    return value


def _free_mark(text: str, strings: list[str]) -> str:
    """A private-use character found neither in the rendered text nor in any client string."""
    for code in _PRIVATE_USE:
        mark = chr(code)
        if mark not in text and not any(mark in s for s in strings):
            return mark
    raise ValueError("every private-use character occurs in this chat: it cannot be rendered")

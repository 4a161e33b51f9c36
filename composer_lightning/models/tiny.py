"""The shipped tiny policy: a ~1M-parameter Llama and its byte-level BPE tokenizer, offline.

`tiny_policy_path()` is a directory loadable with `AutoModelForCausalLM` / `AutoTokenizer`
(and vLLM, `dtype="float32"`), built by `composer_lightning.assets.build_tiny` without any
download. Tokenizer: byte-level BPE (digits split one per token) with special tokens
`<|bos|>` (bos), `<|eot|>` (eos, end of turn), `<|pad|>` and one role token per chat role; the
chat template renders `<|bos|>` then `<|role|>content<|eot|>` per turn and `<|assistant|>` as
the generation prompt. Every turn starts and ends with a special token, so rendering is
prefix-stable at the token level (what `composer_lightning.chat` relies on).

`tiny_tool_policy_path()` is its tool-calling sibling (`build_tiny_tool`): the same kind of
model and tokenizer, a template that also renders the tools, for multi-turn tool episodes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from composer_lightning.models.llama import llama_config

ROLES = ("system", "user", "assistant", "tool")
BOS, EOT, PAD = "<|bos|>", "<|eot|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOT, PAD] + [f"<|{r}|>" for r in ROLES]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] if m['content'] is not none else '' }}<|eot|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHECKSUMS = "CHECKSUMS.sha256"


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 512, split_words: bool = True
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on `texts` (deterministic for a fixed corpus).

    Args:
        texts: training corpus (generated task text).
        vocab_size: total size including the 256 byte symbols and the special tokens.
        split_words: pre-split the text into words and punctuation (GPT-2's regex), so no
            token spans two of them; False lets merges span them (digits stay one per token),
            which shortens formulaic text such as JSON tool calls to a few tokens.

    Returns:
        A `PreTrainedTokenizerFast` with bos/eos/pad set and the chat template attached.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 256,
) -> LlamaConfig:
    """The tiny policy's Llama config (head_dim = hidden / heads ≥ 32: vLLM's CPU attention)."""
    return llama_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )


def tiny_policy_path() -> str:
    """The directory of the shipped tiny policy (`composer_lightning/assets/tiny_policy`)."""
    return str(Path(__file__).resolve().parent.parent / "assets" / "tiny_policy")


def tiny_tool_policy_path() -> str:
    """The directory of the shipped tiny tool policy (`composer_lightning/assets/
    tiny_tool_policy`, built by `composer_lightning.assets.build_tiny_tool`): it plays
    `ToolCalc` episodes, calling its `add` tool, sometimes wrongly."""
    return str(Path(__file__).resolve().parent.parent / "assets" / "tiny_tool_policy")


def file_checksums(path: str | Path) -> dict[str, str]:
    """sha256 of every file in `path` (not recursive), except the checksum file itself."""
    root = Path(path)
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.is_file() and p.name != CHECKSUMS
    }


def write_checksums(path: str | Path) -> str:
    """Write `CHECKSUMS.sha256` (`sha256sum` format) for the files in `path`; return its text."""
    text = "".join(f"{digest}  {name}\n" for name, digest in file_checksums(path).items())
    (Path(path) / CHECKSUMS).write_text(text)
    return text


def verify_checksums(path: str | Path | None = None) -> None:
    """Raise ValueError if the files in `path` (default: the shipped policy) differ from
    `CHECKSUMS.sha256` (a changed, missing or extra file)."""
    root = Path(path or tiny_policy_path())
    expected = {}
    for line in (root / CHECKSUMS).read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        expected[name.strip()] = digest
    actual = file_checksums(root)
    if actual != expected:
        bad = sorted(k for k in set(actual) | set(expected) if actual.get(k) != expected.get(k))
        raise ValueError(f"checksum mismatch in {root}: {bad}")

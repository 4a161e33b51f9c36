"""A GGUF file's tokenizer flags survive conversion (`models/gguf_tokenizer.py`), per
architecture, on tiny files the tests write (`_gguf_vocab.py`: Gemma 3 and Llama with a
sentencepiece vocabulary; `_gguf_writer.py`: Llama with a byte-level one).

Each case reads the converted directory as every component does (`AutoTokenizer` on it) and
checks the ids: transformers 5.19 alone adds no BOS where the file says `add_bos_token`, adds
a space prefix to every Llama sentencepiece file, and none to a Gemma file that asks for one.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("gguf")

from transformers import AutoTokenizer  # noqa: E402

from composer_lightning.chat.templates import render_ids, tokenize_prompt  # noqa: E402
from composer_lightning.models.gguf import resolve_gguf  # noqa: E402
from composer_lightning.models.gguf_tokenizer import (  # noqa: E402
    TokenizerKeys,
    read_tokenizer_keys,
)
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from tests.models._gguf_vocab import CHAT_TEMPLATE, write_tiny_gguf  # noqa: E402
from tests.models._gguf_writer import write_llama_gguf  # noqa: E402

BOS, EOS, PAD, UNK, END_OF_TURN = 2, 1, 0, 3, 5


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_LIGHTNING_CACHE", str(tmp_path / "cache"))


def converted(tmp_path, architecture: str, **keys) -> AutoTokenizer:
    """The tokenizer of the converted directory of a tiny file with these tokenizer keys."""
    path = write_tiny_gguf(tmp_path / f"{architecture}.gguf", architecture, **keys)
    return AutoTokenizer.from_pretrained(resolve_gguf(str(path)))


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])
@pytest.mark.parametrize("bos, eos", [(True, False), (False, False), (True, True), (False, True)])
def test_bos_and_eos_flags_survive(tmp_path, architecture, bos, eos):
    tokenizer = converted(tmp_path, architecture, add_bos_token=bos, add_eos_token=eos)
    ids = tokenizer("the cat")["input_ids"]
    assert (ids[0] == BOS) is bos, ids
    assert (ids[-1] == EOS) is eos, ids
    plain = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    assert ids == [BOS] * bos + plain + [EOS] * eos


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])
@pytest.mark.parametrize("prefix", [True, False])
def test_the_space_prefix_of_a_sentencepiece_file_survives(tmp_path, architecture, prefix):
    """`add_space_prefix`: the first word spelled `▁the` or `the`; decoding gives the text."""
    tokenizer = converted(tmp_path, architecture, add_space_prefix=prefix)
    ids = tokenizer("the cat is 12", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[0].startswith("▁") is prefix
    assert tokenizer.decode(ids) == "the cat is 12"


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])
def test_special_ids_and_end_of_turn_survive(tmp_path, architecture):
    """Special tokens at other ids than the builder's defaults, a mask token (transformers
    reads bos/eos/unk/pad ids only), no padding token, and an end-of-turn id, which the
    generation config lists beside EOS (llama.cpp stops at both)."""
    tokenizer = converted(
        tmp_path,
        architecture,
        bos_token_id=4,  # <start_of_turn>, standing in for a BOS elsewhere
        unknown_token_id=UNK,
        padding_token_id=None,
        mask_token_id=END_OF_TURN,
        eot_token_id=END_OF_TURN,
    )
    assert tokenizer.bos_token_id == 4 and tokenizer("a")["input_ids"][0] == 4
    assert tokenizer.mask_token_id == END_OF_TURN
    assert tokenizer.eos_token_id == EOS and tokenizer.unk_token_id == UNK
    directory = tokenizer.name_or_path
    with open(os.path.join(directory, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [EOS, END_OF_TURN]


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])
def test_a_chat_template_renders_one_bos_and_plain_prompts_get_one(tmp_path, architecture):
    """The template writes `{{ bos_token }}` and the tokenizer adds a BOS: a rendered chat
    still starts with exactly one (rendering adds no special tokens); a plain-text prompt (a
    base model without a template) gets the tokenizer's."""
    tokenizer = converted(tmp_path, architecture, chat_template=CHAT_TEMPLATE)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "1+1=?"}]
    ids = render_ids(tokenizer, chat, add_generation_prompt=True)
    assert ids[0] == BOS and ids.count(BOS) == 1, ids
    assert tokenize_prompt(tokenizer, {"messages": chat}) == ids

    (tmp_path / "base").mkdir()
    base = converted(tmp_path / "base", architecture)  # no template
    ids = tokenize_prompt(base, {"prompt": "1+1="})
    assert ids[0] == BOS and ids.count(BOS) == 1, ids


def test_a_byte_level_llama_file_keeps_its_flags(tmp_path):
    """The byte-level (gpt2) tokenizer: `add_bos_token` on and off; `add_space_prefix` is not
    read for it (llama.cpp does not either)."""
    for bos in (True, False):
        path = write_llama_gguf(tiny_policy_path(), tmp_path / f"bpe-{bos}.gguf", add_bos=bos)
        tokenizer = AutoTokenizer.from_pretrained(resolve_gguf(str(path)))
        ids = tokenizer("1+1=")["input_ids"]
        assert (ids[0] == tokenizer.bos_token_id) is bos, ids
        keys = TokenizerKeys.of(read_tokenizer_keys(str(path)))
        assert keys.add_bos_token is bos and keys.model == "gpt2"


def test_an_encoders_separator_flag_is_refused_in_one_line(tmp_path):
    path = write_tiny_gguf(tmp_path / "sep.gguf", "gemma3", add_sep_token=True)
    with pytest.raises(ValueError) as err:
        resolve_gguf(str(path))
    text = str(err.value)
    assert "\n" not in text and "add_sep_token" in text and "causal LM" in text, text


def test_the_keys_reader_skips_the_vocabulary_and_reads_every_scalar(tmp_path):
    path = write_tiny_gguf(tmp_path / "keys.gguf", "gemma3", chat_template="{{ x }}")
    keys = read_tokenizer_keys(str(path))
    assert keys["ggml.add_bos_token"] is True and keys["ggml.bos_token_id"] == BOS
    assert keys["chat_template"] == "{{ x }}" and keys["general.architecture"] == "gemma3"
    assert "ggml.tokens" not in keys  # arrays are skipped, not read

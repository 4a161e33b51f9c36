"""Tiny GGUF files of several architectures and tokenizer kinds, with any tokenizer flags, for
tests only: a random model of a few hundred KiB written the way llama.cpp's converter writes it
(tensor names from `gguf`'s own name map, Gemma's norms stored as `1 + w`), and a sentencepiece
vocabulary (`tokenizer.ggml.model = llama`: `▁`-spelled pieces, byte fallback) built here.

`write_tiny_gguf(path, "gemma3", add_bos_token=True)` writes a Gemma 3 file whose tokenizer keys
are the defaults of `SPM_KEYS` updated with the keywords (a keyword set to None leaves the key
out of the file, as a file without it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

#: A sentencepiece vocabulary: the four specials at Gemma's ids, an end-of-turn token, the 256
#: byte-fallback tokens, then pieces (whole words of the test texts, `▁`-spelled).
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz0123456789+=?.,", "▁the", "▁is", "▁of", "▁a", "▁1"]
PIECES += ["th", "he", "▁t", "▁i", "▁o", "is", "of"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

#: The tokenizer keys a sentencepiece file carries by default (Gemma 3 270M's values).
SPM_KEYS: dict[str, Any] = {
    "bos_token_id": 2,
    "eos_token_id": 1,
    "unknown_token_id": 3,
    "padding_token_id": 0,
    "add_bos_token": True,
    "add_eos_token": False,
    "add_sep_token": False,
    "add_space_prefix": False,
}


def spm_tokens() -> tuple[list[str], list[float], list[int]]:
    """`(tokens, scores, token types)` of the test vocabulary (types as `gguf.TokenType`)."""
    import gguf

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*SPECIALS, *byte_tokens, *PIECES]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * len(PIECES)
    # longer pieces score higher, so merges built from the scores prefer them
    scores = [0.0] * (len(SPECIALS) + 256) + [
        float(len(p)) - i * 1e-3 for i, p in enumerate(PIECES)
    ]
    return tokens, scores, [int(t) for t in types]


def tiny_config(architecture: str, vocab_size: int) -> Any:
    """A random-weight HF config of `architecture` ("llama" or "gemma3"), head_dim 32 (vLLM on
    CPU needs at least 32)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=SPM_KEYS["bos_token_id"],
        eos_token_id=SPM_KEYS["eos_token_id"],
        pad_token_id=SPM_KEYS["padding_token_id"],
    )
    if architecture == "gemma3":
        return Gemma3TextConfig(**common, sliding_window=512)
    if architecture == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"no tiny config for {architecture!r}")


def write_tiny_gguf(path: str | Path, architecture: str = "gemma3", **keys: Any) -> Path:
    """Write a tiny random `architecture` model with the test sentencepiece vocabulary.

    Args:
        keys: tokenizer keys by their short name (`add_bos_token`, `padding_token_id`,
            `chat_template`, `eot_token_id`, ...): `SPM_KEYS` updated with these; None leaves
            the key out.
    """
    import gguf
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokens, scores, types = spm_tokens()
    config = tiny_config(architecture, len(tokens))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = {"gemma3": gguf.MODEL_ARCH.GEMMA3, "llama": gguf.MODEL_ARCH.LLAMA}[architecture]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    writer.add_vocab_size(len(tokens))
    if architecture == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    write_tokenizer_keys(writer, {**SPM_KEYS, **keys})

    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight":  # tied
            continue
        name = names.get_name(hf, try_suffixes=(".weight",))
        if name is None:
            raise KeyError(f"no GGUF name for {hf}")
        data = tensor.to(torch.float32).numpy()
        if architecture == "gemma3" and "norm" in name:
            data = data + 1  # llama.cpp stores Gemma's (1 + w) norm weights
        elif architecture == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            data = permute(data, heads)
        writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's query/key row permutation (`LlamaModel.permute`)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tokenizer_keys(writer: Any, keys: dict[str, Any]) -> None:
    """Write `tokenizer.ggml.<name>` (and `tokenizer.chat_template`) for each non-None value:
    booleans as bools, ids as uint32, templates as strings."""
    for name, value in keys.items():
        if value is None:
            continue
        if name == "chat_template":
            writer.add_chat_template(value)
        elif isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{name}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{name}", value)
        else:
            raise TypeError(f"tokenizer key {name}: {value!r}")

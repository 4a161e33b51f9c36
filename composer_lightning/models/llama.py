"""The one place small Llama configs are made (tiny policy, random test models, factories)."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig


def llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    **extra: Any,
) -> LlamaConfig:
    """A Llama config with full multi-head attention; head_dim = hidden / heads must be ≥ 32
    (vLLM's CPU attention refuses smaller heads).

    Args:
        **extra: further `LlamaConfig` fields (token ids, `initializer_range`, `dtype`, ...).
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if hidden_size // num_heads < 32:
        raise ValueError(
            f"head_dim = {hidden_size // num_heads} < 32; vLLM's CPU attention needs >= 32"
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )

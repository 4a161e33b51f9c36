"""Tiny randomly initialised Llama checkpoints for tests and benchmarks (no tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from composer_lightning.models.llama import llama_config


def build_random_llama(
    path: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.1,
) -> str:
    """Save a randomly initialised `LlamaForCausalLM` (safetensors) to `path`.

    Deterministic given `seed`; the global torch RNG is left as it was. vLLM's CPU attention
    needs head_dim = hidden_size / num_heads ≥ 32. Engines take token ids, so no tokenizer is
    saved (vLLM runs with `skip_tokenizer_init=True`). `initializer_range` is larger than
    HF's 0.02 so that next-token distributions are far from uniform.

    Returns:
        `path` as a string.
    """
    config = llama_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers' `to`
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def load_policy(path: str | Path) -> LlamaForCausalLM:
    """Load a saved Llama as a float32 policy in train mode."""
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.train()

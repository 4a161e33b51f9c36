"""`nn.Module` factories that YAML configs can name by `class_path`."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from composer_lightning.models.llama import llama_config


class TinyLlama(LlamaForCausalLM):
    """A randomly initialised Llama-architecture causal LM, built offline and deterministically.

    Args:
        vocab_size: vocabulary size.
        hidden_size: model width.
        num_layers: decoder layers.
        num_heads: attention heads (`hidden_size / num_heads` is the head dim).
        intermediate_size: MLP width.
        max_position_embeddings: the longest sequence the model takes.
        seed: initialisation seed (the global RNG is untouched).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        intermediate_size: int = 128,
        max_position_embeddings: int = 512,
        seed: int = 0,
    ):
        config = llama_config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            super().__init__(config)
        self.train()

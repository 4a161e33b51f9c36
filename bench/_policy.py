"""What the benches that sample with HF `generate` share: the policy and its tokenizer, loaded
from any model source a run accepts (a directory, a hub id, a `.gguf` file, `pkg:`), in fp32
and eval mode, with the torch threads and seed set first. Not a bench of its own: the benches
that import it run it (`tests/test_benches.py`, `ELSEWHERE`)."""

from __future__ import annotations

from typing import Any


def load_policy(spec: str, threads: int, seed: int | None = None) -> tuple[Any, Any]:
    """`(tokenizer, model)` of `spec`, after `torch.set_num_threads(threads)` and, with a
    `seed`, `torch.manual_seed(seed)`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_lightning.models.hub import resolve_model

    torch.set_num_threads(threads)
    if seed is not None:
        torch.manual_seed(seed)
    path = resolve_model(spec, what="--model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

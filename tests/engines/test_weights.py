from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from composer_lightning.engines import iter_hf_weights


def test_plain_module_names_and_tensors(tiny_policy):
    gathered = list(iter_hf_weights(tiny_policy))
    expected = dict(tiny_policy.named_parameters())
    assert [n for n, _ in gathered] == list(expected)
    for name, tensor in gathered:
        assert not tensor.requires_grad
        assert torch.equal(tensor, expected[name])


def test_wrapper_prefixes_are_stripped():
    class Wrapper(nn.Module):  # what torch.compile / FSDP1 insert into names
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    inner = nn.Sequential(nn.Linear(2, 2))
    inner._fsdp_wrapped_module = nn.Linear(2, 3)
    names = [n for n, _ in iter_hf_weights(Wrapper(inner))]
    assert names == ["0.weight", "0.bias", "weight", "bias"]


@pytest.mark.slow  # two ranks in processes of their own
def test_fsdp2_sharded_module_gathers_full_tensors():
    """Two gloo ranks, FSDP2 `fully_shard`: every rank gets each full tensor (DTensor gather)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = Path(__file__).parents[2]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_fsdp_gather.py"), port],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_tied_weights_are_yielded_under_every_name():
    """vLLM's in-place reload needs a tied LM head by name, or it keeps the old one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from composer_lightning.engines import iter_hf_weights

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=1,
            intermediate_size=64,
            tie_word_embeddings=True,
        )
    )
    names = [n for n, _ in iter_hf_weights(model)]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names

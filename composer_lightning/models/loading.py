"""Loading causal LMs from a local directory (offline) or taking a given module."""

from __future__ import annotations

import os

import torch
from torch import nn


def load_causal_lm(spec: str | nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Return `spec` if it is a module, else load the HF causal LM saved in directory `spec`.

    The loaded model is in train mode (HF `from_pretrained` returns eval mode).
    """
    if isinstance(spec, nn.Module):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a model is a local HF directory or an nn.Module, got {type(spec).__name__}")
    if not os.path.isdir(spec) or not os.path.isfile(os.path.join(spec, "config.json")):
        raise FileNotFoundError(
            f"model directory {spec!r} not found or has no config.json; expected a local HF model "
            "directory (nothing is downloaded from a hub)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).train()

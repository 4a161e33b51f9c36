"""Loading causal LMs from a local directory (offline) or taking a given module."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn


def load_causal_lm(spec: str | nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Return `spec` if it is a module, else load the HF causal LM saved in directory `spec`.

    The loaded model is in train mode (HF `from_pretrained` returns eval mode).
    """
    if isinstance(spec, nn.Module):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a model is a local HF directory or an nn.Module, got {type(spec).__name__}"
        )
    if not os.path.isdir(spec) or not os.path.isfile(os.path.join(spec, "config.json")):
        raise FileNotFoundError(
            f"model directory {spec!r} not found or has no config.json; expected a local HF model "
            "directory (nothing is downloaded from a hub)"
        )
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).train()


def hparams_to_ignore(**args: Any) -> list[str]:
    """Arguments to keep out of the checkpoint's hyper-parameters.

    Under LightningCLI the hyper-parameters are the parsed `class_path` config (safe to load with
    `weights_only`, and `load_from_checkpoint` rebuilds from them); built in Python, the heads,
    models and factories are live objects, which are not stored.
    """
    try:
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

        if _given_hyperparameters.get() is not None:
            return []
    except ImportError:  # pragma: no cover - a Lightning without the CLI context
        pass
    return [k for k, v in args.items() if v is not None and not isinstance(v, (str, int, float))]


def frozen_model(model: str | nn.Module | None) -> nn.Module | None:
    """A frozen (no grad, eval mode) model from a directory or module; None stays None."""
    if model is None:
        return None
    m = load_causal_lm(model)
    m.requires_grad_(False)
    return m.eval()


def reference_model(
    reference: str | nn.Module | None, policy: nn.Module, heads: list
) -> nn.Module | None:
    """The frozen reference: the given one, else a frozen copy of the policy when a head with a
    non-zero weight reads reference log-probs, else None (no copy is made)."""
    if reference is None and any("ref_logprobs" in h.requires and h.weight > 0 for h in heads):
        reference = copy.deepcopy(policy)
    return frozen_model(reference)

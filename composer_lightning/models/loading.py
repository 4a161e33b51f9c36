"""Loading causal LMs from a local directory or hub id (`models/hub.py`), or taking a module."""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from typing import Any

import torch
from torch import nn

from composer_lightning.models.gguf import PACKAGE_PREFIX, is_gguf_spec
from composer_lightning.models.hub import resolve_model
from composer_lightning.models.lora import AdapterFreeReference, is_lora
from composer_lightning.models.stored import (
    checkpoint_meta,
    loading_checkpoint,
    stored_model_files,
    write_model_files,
)

log = logging.getLogger(__name__)


def load_causal_lm(
    spec: str | nn.Module,
    dtype: torch.dtype = torch.float32,
    what: str = "model",
    init_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Return `spec` if it is a module, else load the HF causal LM it names: a local directory
    or a hub id (`models/hub.resolve_model`), with `init_kwargs` for `from_pretrained` (TRL's
    `model_init_kwargs`: `dtype`, `attn_implementation`, ...; they win over `dtype`).

    The loaded model is in train mode (HF `from_pretrained` returns eval mode).
    """
    if isinstance(spec, nn.Module):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a model is a local HF directory, a hub id or an nn.Module, got {type(spec).__name__}"
        )
    from transformers import AutoModelForCausalLM

    path = resolve_model(spec, what=what)
    kwargs = {"dtype": dtype, **(init_kwargs or {})}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).train()


def absolute_spec(spec: Any) -> Any:
    """A relative local directory or GGUF file (or its chunks) made absolute (so a checkpoint's
    hyper-parameters name it from any working directory); hub ids, `pkg:` files, absolute
    paths and modules unchanged."""
    chunked = is_gguf_spec(spec) and not spec.startswith(PACKAGE_PREFIX)
    local = isinstance(spec, str) and (os.path.isdir(spec) or os.path.isfile(spec) or chunked)
    if local and not os.path.isabs(spec):
        return os.path.abspath(spec)
    return spec


def load_policy(
    spec: str, what: str = "model.policy", init_kwargs: dict[str, Any] | None = None
) -> tuple[str, nn.Module]:
    """The policy's resolved local directory and the model loaded from it.

    While `ComposerModule.load_from_checkpoint` builds a module, a policy that no longer
    resolves (the directory moved, the hub cache is empty) is built from the config files the
    checkpoint stored (`models/stored.py`), in a temporary directory that also holds the
    tokenizer (no weights); its weights are the checkpoint's, loaded next by Lightning.
    """
    try:
        path = resolve_model(spec, what=what)
    except FileNotFoundError as missing:
        ckpt = loading_checkpoint.get()
        files = stored_model_files(checkpoint_meta(ckpt)) if ckpt else {}
        if "config.json" not in files:
            raise
        assert ckpt is not None  # the files came from it
        return _from_stored_files(spec, ckpt, files, missing)
    return path, load_causal_lm(path, init_kwargs=init_kwargs)


def _from_stored_files(
    spec: str, ckpt: str, files: dict[str, bytes], missing: Exception
) -> tuple[str, nn.Module]:
    from transformers import AutoConfig, AutoModelForCausalLM

    # a few small files (no weights), left for the engines and the tokenizer to read
    directory = tempfile.mkdtemp(prefix="composer_lightning-policy-")
    write_model_files(files, directory)
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    log.warning(
        "the policy %r does not resolve here (%s); built from the config stored in %s",
        spec,
        missing,
        ckpt,
    )
    return directory, model


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


def frozen_model(
    model: str | nn.Module | None, what: str = "model", init_kwargs: dict[str, Any] | None = None
) -> nn.Module | None:
    """A frozen (no grad, eval mode) model from a directory or module; None stays None."""
    if model is None:
        return None
    m = load_causal_lm(model, what=what, init_kwargs=init_kwargs)
    m.requires_grad_(False)
    return m.eval()


def reference_model(
    reference: str | nn.Module | None,
    policy: nn.Module,
    heads: list,
    init_kwargs: dict[str, Any] | None = None,
) -> nn.Module | None:
    """The frozen reference: the given one, else, when a head with a non-zero weight reads
    reference log-probs, the policy with its adapters off for a LoRA policy (no copy,
    `models/lora.AdapterFreeReference`) or a frozen copy of the policy; else None."""
    if reference is None and any("ref_logprobs" in h.requires and h.weight > 0 for h in heads):
        if is_lora(policy):
            return AdapterFreeReference(policy)
        reference = copy.deepcopy(policy)
    return frozen_model(reference, "model.reference", init_kwargs)

"""Gathering a (possibly FSDP2-sharded, compiled) module's weights under their HF names."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from composer_lightning.models.lora import base_name, is_lora, merged_weight, unsharded

# Prefixes that wrappers add to parameter names (torch.compile, FSDP1, activation checkpointing).
_WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def hf_name(name: str) -> str:
    """Strip wrapper components from a parameter name, wherever they occur."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def iter_hf_weights(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield `(hf_name, full_tensor)` for every parameter of `module`, one at a time.

    A DTensor (FSDP2 shard) is gathered with `.full_tensor()`, which is a collective: every
    rank must iterate to the end, in the same order. Tied weights appear under each of
    their names: vLLM's in-place reload leaves a tied LM head stale unless it is named.
    Tensors are detached; gathered ones are fresh copies, plain ones share storage with the
    module (callers copy them).

    Args:
        module: the policy, e.g. a `LlamaForCausalLM`, possibly wrapped or sharded; a LoRA
            policy (peft) yields its merged weights under the base model's names
            (`merged_hf_weights`).

    Yields:
        The HF parameter name and the full, detached tensor.
    """
    if is_lora(module):
        yield from merged_hf_weights(module)
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        yield hf_name(name), unsharded(param)


@torch.no_grad()
def merged_hf_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield `(hf_name, full_tensor)` of the merged base model, one at a time, in the order of
    `named_parameters` (tied weights under each name): the engines' view of a LoRA policy.

    A DTensor (FSDP2 shard) is gathered, a collective: every rank iterates to the end.
    """
    for raw, param in model.named_parameters(remove_duplicate=False):
        name = hf_name(raw)
        if any(part.startswith("lora_") for part in name.split(".")):
            continue  # merged into its base weight
        owner, _, leaf = raw.rpartition(".base_layer.")
        if owner and leaf == "weight":
            yield base_name(name), merged_weight(model.get_submodule(owner))
        else:
            yield base_name(name), unsharded(param)

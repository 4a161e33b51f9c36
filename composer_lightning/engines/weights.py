"""Gathering a (possibly FSDP2-sharded, compiled) module's weights under their HF names."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

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
            (`models/lora.merged_hf_weights`).

    Yields:
        The HF parameter name and the full, detached tensor.
    """
    from composer_lightning.models.lora import is_lora, merged_hf_weights

    if is_lora(module):
        yield from merged_hf_weights(module)
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # DTensor, without importing torch.distributed.tensor
            tensor = tensor.full_tensor()
        yield hf_name(name), tensor

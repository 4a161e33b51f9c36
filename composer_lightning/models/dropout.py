"""Dropout off in every trainer forward, as verl and OpenRLHF train RL.

The policy stays in `train()` mode (Lightning's, and activation checkpointing's), so its dropout
would be live in every forward of the step: the old, reference, teacher and canary log-probs
would be draws, the first update's ratio would not be 1, two micro-batch passes would see
different masks, and an engine (which never drops) would read as out of sync. So the trainer
turns dropout off where it lives: every `nn.Dropout` (peft's `lora_dropout` among them) gets
`p = 0`, and every float dropout rate an attention module passes to its kernel
(`attention_dropout`, as HF's Llama, Qwen and Mistral attention do) becomes 0. The model's
config is left as it was, so an exported model keeps its own settings.
"""

from __future__ import annotations

from torch import nn

#: Float attributes that HF modules pass to their attention kernels as a dropout rate.
RATE_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout")


def without_dropout(model: nn.Module) -> int:
    """Turn every dropout of `model` off, in place; return how many were on."""
    turned = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            turned += module.p > 0
            module.p = 0.0
            continue
        for name in RATE_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                turned += 1
    return turned

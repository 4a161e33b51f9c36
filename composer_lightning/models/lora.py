"""LoRA policies (`peft`): the wrapped policy, its reference at no cost, its merged weights.

- `lora_policy` wraps a loaded policy with `peft.get_peft_model`: only the adapters train.
- `AdapterFreeReference` is the reference of a LoRA policy: the same model with its adapters
  off (`disable_adapter()`), so the reference costs no memory (no frozen copy).
- `merged_hf_weights` streams what engines load: each targeted weight merged,
  `W + B @ A · scale` (as peft's `merge` computes it), under the base model's HF names; every
  other weight as it is. One tensor at a time; the policy itself is never merged in place.

Simplified: plain LoRA on linear layers only. DoRA and the other variants, LoRA on embeddings
or on the LM head (the forwards apply the LM head weight themselves, `training/forward.py`), and
`modules_to_save` / trainable tokens are refused with a `ConfigError`.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from composer_lightning.runtime.errors import ConfigError

# jsonargparse fills LoraConfig's `loftq_config` with LoftQConfig's defaults, which makes peft
# warn about an option nobody set.
warnings.filterwarnings("ignore", message=r"`loftq_config` specified but will be ignored")

try:  # the type of `model.peft`: with it the command line can set one field of the config
    from peft import LoraConfig
except ImportError:  # peft is the `lora` extra: without it `model.peft` takes anything (and
    LoraConfig = Any  # type: ignore[misc,assignment]  # `lora_policy` says what is missing)

#: The prefix `get_peft_model` puts before the base model's parameter names.
PEFT_PREFIX = "base_model.model."


def is_lora(model: object) -> bool:
    """Whether `model` is a peft model (e.g. `PeftModelForCausalLM`)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "disable_adapter", None))


def lora_policy(policy: nn.Module, config: Any) -> nn.Module:
    """`policy` wrapped with LoRA adapters (`peft.get_peft_model`); the base weights frozen.

    Args:
        policy: the loaded HF causal LM.
        config: a `peft.LoraConfig`.

    Raises:
        ConfigError: peft is not installed, `config` is not a `LoraConfig`, or it asks for
            what the weight push cannot merge (see the module docstring).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("model.peft needs peft: pip install 'composer-lightning[lora]'") from None
    if not isinstance(config, LoraConfig):
        raise ConfigError(f"model.peft must be a peft.LoraConfig, got {type(config).__name__}")
    refused = [
        name
        for name, value in (
            ("use_dora", config.use_dora),
            ("modules_to_save", config.modules_to_save),
            ("trainable_token_indices", getattr(config, "trainable_token_indices", None)),
            ("lora_bias", config.lora_bias),
        )
        if value
    ]
    if refused:
        raise ConfigError(
            f"model.peft: {', '.join(refused)} is not supported (engines get merged weights of "
            "plain LoRA on linear layers)"
        )
    model = get_peft_model(policy, config)
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        if module is head or hasattr(module, "lora_embedding_A") and module.lora_embedding_A:
            raise ConfigError(
                f"model.peft targets {name.removeprefix(PEFT_PREFIX)}: LoRA on embeddings or the "
                "LM head is not supported; target the attention / MLP projections"
            )
        if getattr(module, "lora_variant", None):
            raise ConfigError(f"model.peft: a LoRA variant on {name} is not supported")
    return model


class AdapterFreeReference(nn.Module):
    """The reference of a LoRA policy: the policy's own forward with its adapters disabled.

    Holds no weights of its own and does not register the policy as a submodule (its weights
    are not saved twice); under FSDP2 the forward is the sharded policy's, a collective like
    any policy forward.
    """

    _policy: Any  # a peft model (its methods are not nn.Module's)

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.__dict__["_policy"] = policy  # not a submodule

    def get_output_embeddings(self) -> nn.Module:
        return self._policy.get_output_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self._policy.disable_adapter():
            return self._policy(*args, **kwargs)


def unsharded(t: Tensor) -> Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # DTensor (FSDP2): a collective


def lora_delta(lora_A: Tensor, lora_B: Tensor, scaling: float, fan_in_fan_out: bool) -> Tensor:
    """`[out, in]` the weight update of one adapter, `B @ A · scaling`, computed as peft's
    `lora.Linear.get_delta_weight` does (fp16/bf16 on CPU through fp32), so that
    `W + lora_delta(...)` is bitwise what peft's `merge` writes.

    Args:
        lora_A: `[r, in]` the adapter's down projection.
        lora_B: `[out, r]` its up projection.
        scaling: `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA), the layer's `scaling[adapter]`.
        fan_in_fan_out: the base weight is stored `[in, out]` (GPT-2's Conv1D).
    """
    dtype = lora_B.dtype
    cast = lora_B.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    A, B = (lora_A.float(), lora_B.float()) if cast else (lora_A, lora_B)
    delta = B @ A
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    return delta.to(dtype) if cast else delta


def merged_weight(layer: Any) -> Tensor:  # a peft LoRA layer (lora.Linear)
    """A LoRA layer's base weight plus the update of each active adapter (full, detached)."""
    weight = unsharded(layer.get_base_layer().weight)
    if layer.disable_adapters or layer.merged:  # nothing to add, or added already
        return weight
    for name in layer.active_adapters:
        if name in layer.lora_A:
            delta = lora_delta(
                unsharded(layer.lora_A[name].weight),
                unsharded(layer.lora_B[name].weight),
                layer.scaling[name],
                layer.fan_in_fan_out,
            )
            weight = weight + delta.to(weight.dtype)
    return weight


def base_name(name: str) -> str:
    """A peft parameter name as the base model's HF name (`base_layer.` dropped)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_config(model: nn.Module) -> dict[str, Any] | None:
    """The active adapter's config as plain JSON values (what peft writes to
    `adapter_config.json`), or None for a model without adapters."""
    if not is_lora(model):
        return None
    peft_config: Any = model.peft_config  # peft's (on an nn.Module: typed Tensor | Module)
    config = peft_config[model.active_adapter].to_dict()
    return json.loads(
        json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    )


def lora_model_from_state(
    base: nn.Module, config: dict[str, Any], state: dict[str, Tensor]
) -> nn.Module:
    """The peft model of `base` (built on the meta device) with `config` (`adapter_config`'s
    dict) and the checkpoint's `state` (peft names) assigned: no second copy of the weights."""
    from peft import PeftConfig, get_peft_model

    peft_config = PeftConfig.from_peft_type(**config)
    peft_config.inference_mode = True
    model = get_peft_model(base, peft_config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if "lora_" in k]  # base weights: checked by their loader
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's adapter does not fit its config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    return model

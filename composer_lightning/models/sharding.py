"""FSDP2 sharding of the policy and of the frozen models (reference, separate teacher).

The policy keeps fp32 master weights under bf16 compute. The frozen models are sharded the
same way over the same mesh, so a rank holds 1/N of their parameters too; being frozen, they
have no gradients (nothing is reduce-scattered for them) and every module of theirs, the root
included, reshards right after its forward: no unsharded weights stay between forwards.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from composer_lightning.models.lora import is_lora
from composer_lightning.runtime.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The `data_parallel` dimension of a `ModelParallelStrategy` mesh: FSDP2 shards over it.

    Raises:
        ConfigError: the mesh has a `tensor_parallel` dimension of size > 1. The policy is not
            tensor-parallelised, so the ranks along it would hold copies whose gradients are
            never synced.
    """
    tp = mesh["tensor_parallel"].size() if "tensor_parallel" in (mesh.mesh_dim_names or ()) else 1
    if tp > 1:
        raise ConfigError(
            f"ModelParallelStrategy(tensor_parallel_size={tp}) is not supported: the policy is "
            "sharded with FSDP2 over data_parallel only, so tensor-parallel copies would never "
            "sync their gradients; set data_parallel_size to the number of processes and "
            "tensor_parallel_size=1, and parallelise the engine instead with vLLM's "
            "tensor_parallel_size (the engine's llm_kwargs)"
        )
    return mesh["data_parallel"]


def shard_fsdp2(policy: nn.Module, dp_mesh: DeviceMesh, precision: str) -> None:
    """`fully_shard` each decoder layer, then the root, over the data-parallel mesh.

    With `precision="bf16-mixed"` the sharded (master) parameters and the optimizer state stay
    fp32 while forward and backward run on bf16 copies, and gradients are reduced in fp32
    (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`). The root stays unsharded
    from its forward to the end of its backward (FSDP2's default for a root).
    """
    _shard(policy, dp_mesh, precision, reshard_root=None)


def shard_frozen(model: nn.Module, dp_mesh: DeviceMesh, precision: str) -> None:
    """`fully_shard` a frozen model like the policy (`shard_fsdp2`), its root resharded after
    each forward too: it has no backward that would reshard it.

    Its forwards are collectives: every rank must run the same ones in every step. The LM head
    weight read after a forward is then a sharded DTensor; `full_weight` gathers it.
    """
    _shard(model, dp_mesh, precision, reshard_root=True)


def is_fsdp2(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2's `fully_shard` (its every forward a collective)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """`weight` whole, in the forward's compute `dtype`: a sharded (DTensor) parameter is
    all-gathered (a collective), a plain tensor is returned as is."""
    if hasattr(weight, "full_tensor"):
        return weight.full_tensor().to(dtype)
    return weight


def _shard(
    model: nn.Module, dp_mesh: DeviceMesh, precision: str, reshard_root: bool | None
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # `output_hidden_states` (forward.py) returns the embedding output, a view; nothing modifies
    # it in place, so FSDP2's warning about views is moot here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    base = model.get_base_model() if is_lora(model) else model  # type: ignore[operator]  # peft: the HF model inside
    for layer in getattr(getattr(base, "model", None), "layers", []):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_root)

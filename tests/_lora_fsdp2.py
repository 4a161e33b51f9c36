"""Two gloo ranks shard a LoRA policy with FSDP2 (`models.sharding.shard_fsdp2`, per decoder
layer): the merged weights gathered from the shards are bitwise the unsharded ones, the
adapter-free reference is the base model, and a backward gives gradients to the adapters only.

Usage: python tests/_lora_fsdp2.py PORT; exits 0 when every rank passed.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: str) -> None:
    from peft import LoraConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from composer_lightning.engines import iter_hf_weights
    from composer_lightning.models.lora import AdapterFreeReference, lora_policy
    from composer_lightning.models.sharding import shard_fsdp2
    from composer_lightning.training.forward import score_tokens
    from tests.helpers import tiny_model
    from tests.test_lora import _randomise

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = tiny_model(torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)  # A's initial values: the same on both ranks, as seed_everything gives
    policy = lora_policy(copy.deepcopy(base), config)
    _randomise(policy)
    expected = {n: t.clone() for n, t in iter_hf_weights(policy)}
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    attn, mask = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
    base_lp = score_tokens(base, ids, attn, temperature=1.0, mask=mask).logprobs
    shard_fsdp2(policy, init_device_mesh("cpu", (world,)), "32-true")
    layers = policy.get_base_model().model.layers
    assert all(isinstance(layer, FSDPModule) for layer in layers), "layers not sharded"
    gathered = dict(iter_hf_weights(policy))
    assert gathered.keys() == expected.keys()
    for name, tensor in gathered.items():
        assert torch.equal(tensor, expected[name]), name
    ref_lp = score_tokens(AdapterFreeReference(policy), ids, attn, temperature=1.0, mask=mask)
    torch.testing.assert_close(ref_lp.logprobs, base_lp, rtol=0, atol=1e-6)
    score_tokens(policy, ids, attn, temperature=1.0, mask=mask).logprobs.sum().backward()
    for name, p in policy.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort interpreter teardown (see engines/_fsdp_gather.py)


if __name__ == "__main__":
    mp.spawn(_rank, args=(2, sys.argv[1] if len(sys.argv) > 1 else "29519"), nprocs=2)

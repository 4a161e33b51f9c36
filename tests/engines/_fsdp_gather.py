"""Two gloo ranks shard a module with FSDP2 and gather it back with `iter_hf_weights`.

Usage: python tests/engines/_fsdp_gather.py; exits 0 when every rank got the full weights.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def _rank(rank: int, world: int, port: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from composer_lightning.engines import iter_hf_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    reference = {k: v.clone() for k, v in _model().state_dict().items()}
    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    assert model[0].weight.to_local().shape[0] == 3, "not sharded"
    gathered = dict(iter_hf_weights(model))
    assert gathered.keys() == reference.keys(), (gathered.keys(), reference.keys())
    for name, tensor in gathered.items():
        assert type(tensor) is torch.Tensor and not tensor.requires_grad, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's background threads can abort it ("terminate called
    # without an active exception"), which would fail a rank that did all its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    port = sys.argv[1] if len(sys.argv) > 1 else "29517"
    mp.spawn(_rank, args=(2, port), nprocs=2)

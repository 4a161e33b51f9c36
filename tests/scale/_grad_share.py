"""Measure the heads' gradient shares (and match gradient norms) on two gloo ranks, the policy
sharded with FSDP2; every rank saves what it measured.

    python tests/scale/_grad_share.py OUT.pt

Each rank: its own synthetic batch (seed 10 + rank), Dr. GRPO + OPD + a KL loss head, float64.
It runs the objective twice, measuring and not, and backpropagates each (the measurement must
leave FSDP2's backward, which averages the ranks' gradients, as it was), then once with
`grad_norm_matching="dr_grpo"`, and once measuring in micro-batches of 3 rows (the states kept
as pass 1's leaves, FSDP2's LM head stood in for by a copy: `accumulate.py`).
`tests/scale/test_grad_share.py` compares with one process.
"""

import gc
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh


def heads():
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.kl import KLHead
    from composer_lightning.heads.opd import OPDHead

    return [DrGRPOHead(), OPDHead(weight=0.5), KLHead(0.2, "k3", "loss", name="kl")]


def module(**kwargs):
    from composer_lightning.training.module import ComposerModule
    from tests.helpers import tiny_model

    kwargs.setdefault("teacher_cap", None)  # the shares of the weights as given
    return ComposerModule(tiny_model(seed=1), heads(), reference=tiny_model(seed=2), **kwargs)


def batch(rank: int):
    from composer_lightning.datamodules.synthetic import synthetic_batch

    return synthetic_batch(
        torch.Generator().manual_seed(10 + rank), prompts=2, group_size=4, vocab_size=64
    )


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _measure(rank, out)
    # the sharded modules and the collectives' work they hold, freed while Python fully runs
    # (at interpreter exit gloo's threads can abort: "terminate called without an active
    # exception"), then the group
    gc.collect()
    dist.destroy_process_group()


def _measure(rank: int, out: str) -> None:
    from composer_lightning.models.sharding import shard_fsdp2

    mesh = init_device_mesh("cpu", (2,))
    b, saved = batch(rank), {}
    for name, kwargs in (("plain", {}), ("matched", {"grad_norm_matching": "dr_grpo"})):
        m = module(**kwargs)
        shard_fsdp2(m.policy, mesh, "32-true")
        weights = m.objective.weights(0)
        needs = m.objective.requirements(weights)
        for measure in (True, False) if name == "plain" else (False,):
            m.policy.zero_grad()
            loss, metrics = m.objective(
                b, m.step_context(b, needs), weights, measure_gradients=measure
            )
            loss.backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in m.policy.named_parameters()}
            saved[f"{name}_{measure}"] = {"metrics": metrics, "grads": grads}
    saved["micro_True"] = _micro(b, mesh)
    torch.save(saved, f"{out}.rank{rank}")


def _micro(b, mesh) -> dict:
    from composer_lightning.models.sharding import shard_fsdp2
    from composer_lightning.training import accumulate
    from composer_lightning.training.microbatch import plans

    m = module(micro_batch_size=3)
    shard_fsdp2(m.policy, mesh, "32-true")
    weights = m.objective.weights(0)
    needs = m.objective.requirements(weights)
    plan = plans(b, [torch.arange(len(b.input_ids))], m.micro_batching)[0]
    scores = accumulate.outputs(m.forwards, b, plan, needs, states=True)
    ctx = m.step_context(b, needs, scores=scores)
    loss, metrics = m.objective(b, ctx, weights, measure_gradients=True)
    accumulate.backward(m.forwards, loss, scores, b, plan, needs, lambda x: x.backward())
    grads = {n: p.grad.full_tensor().clone() for n, p in m.policy.named_parameters()}
    return {"metrics": metrics, "grads": grads}


if __name__ == "__main__":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    mp.spawn(_rank, args=(port, sys.argv[1]), nprocs=2)

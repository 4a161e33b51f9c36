"""The canary's recompute of a stale batch at its generating version (`version_logprobs`):
the policy's own forward with that version's values, plain and FSDP2-sharded, equal to an
independent model holding that version, and the policy's own values put back bit for bit."""

from __future__ import annotations

import datetime
import gc

import pytest
import torch
import torch.distributed as dist

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.models.sharding import shard_fsdp2
from composer_lightning.models.weights import iter_hf_weights
from composer_lightning.training.canary import CANARY_ROWS, version_logprobs
from composer_lightning.training.forward import score_tokens
from tests.helpers import tiny_model


def _version(model, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in iter_hf_weights(model)}


def _check(policy, reference, old: dict, current: dict | None) -> None:
    rb = synthetic_batch(torch.Generator().manual_seed(0), vocab_size=64)
    before = {n: t.clone() for n, t in iter_hf_weights(policy)}
    got = version_logprobs(policy, old, rb, 0.7, None, current=current)
    with torch.no_grad():  # the independent value: a model holding the old version
        for n, p in reference.named_parameters():
            p.copy_(old[n])
        want = score_tokens(
            reference, rb.input_ids, rb.attention_mask, temperature=0.7, mask=rb.response_mask
        ).logprobs
    rows = min(CANARY_ROWS, rb.batch_size)
    torch.testing.assert_close(got[:rows], want[:rows], rtol=0, atol=1e-12)
    assert torch.isnan(got[rows:]).all()
    after = dict(iter_hf_weights(policy))
    for name, t in before.items():
        assert torch.equal(after[name], t), name  # put back bit for bit
    with torch.no_grad():  # the policy's next forward is the current version's, all of it
        now = score_tokens(
            policy, rb.input_ids, rb.attention_mask, temperature=0.7, mask=rb.response_mask
        ).logprobs
        for n, p in reference.named_parameters():
            p.copy_(before[n])
        want_now = score_tokens(
            reference, rb.input_ids, rb.attention_mask, temperature=0.7, mask=rb.response_mask
        ).logprobs
    torch.testing.assert_close(now, want_now, rtol=0, atol=1e-12)
    assert not torch.allclose(now[:rows], want[:rows])  # the versions do differ


@pytest.mark.parametrize("restore_from", ["published copy", "own copy"])
def test_a_plain_policy(restore_from):
    policy, reference = tiny_model(), tiny_model()
    old = _version(policy, 0.05)
    current = {n: t.clone() for n, t in iter_hf_weights(policy)}
    _check(policy, reference, old, current if restore_from == "published copy" else None)


def test_an_fsdp2_sharded_policy(tmp_path):
    """One gloo rank, `fully_shard` as under ModelParallelStrategy: parameters are DTensors,
    and the root stays unsharded after a forward without backward unless resharded."""
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()  # another in-process test may have left one
    if created:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp_path / 'store'}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    assert dist.get_world_size() == 1
    try:
        policy, reference = tiny_model(), tiny_model()
        old = _version(policy, 0.05)
        current = {n: t.clone() for n, t in iter_hf_weights(policy)}
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        shard_fsdp2(policy, mesh, "64-true")
        assert all(hasattr(p, "full_tensor") for p in policy.parameters())
        _check(policy, reference, old, current)
    finally:
        if created:
            dist.destroy_process_group()
        gc.collect()

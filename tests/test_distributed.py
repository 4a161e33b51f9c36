"""`agree` over two real gloo ranks: metrics reduced by kind (means weighted by each rank's
count), and an error on one rank raised on both."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from composer_lightning.runtime.distributed import (
    RankError,
    StepMetrics,
    agree,
    most,
    own,
    per_rank,
    shared_seed,
)

# What each rank logs: rank 0 has 4 rewarded samples of mean 0.75, rank 1 has 12 of mean 0.
PER_RANK = [
    {
        "mean": [("rollout/reward_mean", 0.75, 4.0), ("gap", 0.5, 0.0), ("only_0", 2.0, 3.0)],
        "sum": [("dispatch/rl_only", 3.0)],
        "max": [("rollout/response_length_max", 0.2)],
    },
    {
        "mean": [("rollout/reward_mean", 0.0, 12.0), ("gap", 0.25, 0.0)],
        "sum": [("dispatch/rl_only", 5.0)],
        "max": [("rollout/response_length_max", 0.9)],
    },
]
# By hand: (0.75·4 + 0·12) / 16 (not (0.75 + 0) / 2 = 0.375); zero total weight: the plain mean
# (0.5 + 0.25) / 2; a name only rank 0 logs is its own value; counts summed; maxima maxed.
EXPECTED = {
    "rollout/reward_mean": 3.0 / 16.0,
    "gap": 0.375,
    "only_0": 2.0,
    "dispatch/rl_only": 8.0,
    "rollout/response_length_max": 0.9,
}


def _rank(rank: int, store: str, results: dict) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    metrics = StepMetrics()
    for name, value, weight in PER_RANK[rank]["mean"]:
        metrics.mean(name, value, weight=weight)
    for kind in ("sum", "max"):
        for name, value in PER_RANK[rank][kind]:
            getattr(metrics, kind)(name, value)
    reduced = agree(metrics)
    try:
        agree(error=ValueError("bad\nbatch") if rank == 1 else None)
        raised = None
    except RankError as exc:
        raised = str(exc)
    results[rank] = {
        "reduced": reduced,
        "raised": raised,
        "seed": shared_seed(),
        "per_rank": per_rank({"rank": rank}),
        "own": own([f"state of {r}" for r in range(2)]),
        "most": most(10 + 5 * rank),  # the tokens each rank's prompts need: one engine size
    }
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two ranks in processes of their own
def test_agree_reduces_by_kind_and_raises_one_rank_error_on_both(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        reduced = results[rank]["reduced"]
        assert reduced.keys() == EXPECTED.keys()
        for name, want in EXPECTED.items():
            assert reduced[name] == pytest.approx(want, rel=0, abs=1e-15), (rank, name)
        assert results[rank]["raised"] == "rank 1: ValueError: bad batch"
        assert results[rank]["per_rank"] == [{"rank": 0}, {"rank": 1}]
        assert results[rank]["own"] == f"state of {rank}"
        assert results[rank]["most"] == 15
    assert results[0]["seed"] == results[1]["seed"]  # one draw: a TP group samples alike


def test_one_process_returns_its_own_values_and_reraises_its_error():
    metrics = StepMetrics()
    metrics.mean("rollout/reward_mean", 0.75, weight=4.0)
    metrics.sum("dispatch/rl_only", 3.0)
    assert agree(metrics) == {"rollout/reward_mean": 0.75, "dispatch/rl_only": 3.0}
    with pytest.raises(ValueError, match="^bad$"):
        agree(error=ValueError("bad"))

"""FSDP2 (ModelParallelStrategy + fully_shard in configure_model) equals DDP on CPU with gloo:
two ranks, each its own rollout stream, gradients averaged across ranks."""

import os
import subprocess
import sys
import time

import pytest
import torch

from composer_lightning.models.factory import TinyLlama
from tests.test_cli import ROOT


def _train(kind: str, tmp_path) -> list[dict]:
    out = tmp_path / f"{kind}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scale" / "_train.py"), kind, str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{out}.rank{r}") for r in (0, 1)]


def test_fsdp2_matches_ddp_on_two_cpu_ranks(tmp_path):
    ddp, fsdp = _train("ddp", tmp_path)[0], _train("fsdp2", tmp_path)[0]
    assert fsdp["sharded"] and not ddp["sharded"]
    init = dict(
        TinyLlama(
            vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, seed=0
        ).named_parameters()
    )
    assert ddp["weights"].keys() == fsdp["weights"].keys()
    for name, w in ddp["weights"].items():
        torch.testing.assert_close(fsdp["weights"][name], w, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(w, init[n].detach()) for n, w in ddp["weights"].items())


def test_fsdp2_rollouts_shard_prompts_and_keep_every_rank_engine_in_sync(tmp_path):
    """Two ranks, each with its own engine: different prompts per rank, the same weights after
    every step on both ranks, and each rank's engine in sync (canary gap ≈ 1e-6)."""
    ranks = _train("fsdp2_rollout", tmp_path)
    seen0, seen1 = ranks[0]["seen"], ranks[1]["seen"]
    assert len(seen0) == len(seen1) == 3
    for a, b in zip(seen0, seen1, strict=True):
        assert not set(a["prompts"]) & set(b["prompts"])
        assert a["gap"] < 1e-5 and b["gap"] < 1e-5
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name])


def test_uneven_ranks_train_on_and_log_metrics_of_both_ranks(tmp_path):
    """Rank 1 has a constant reward and no hints: an empty replay buffer, no SDPO or OPD term
    and a placeholder teacher forward, while rank 0 has all of them; both train on, with the
    same weights, and the logged reward mean is the mean over both ranks' samples."""
    r0, r1 = (rank["seen"] for rank in _train("fsdp2_uneven", tmp_path))
    assert len(r0) == len(r1) == 3
    assert all(s["buffer"] == 0 for s in r1) and any(s["buffer"] > 0 for s in r0)
    for a, b in zip(r0, r1, strict=True):
        both = a["rewards"] + b["rewards"]
        assert set(b["rewards"]) == {0.5}
        assert (
            a["reward_mean"] == b["reward_mean"] == pytest.approx(sum(both) / len(both), abs=1e-6)
        )
        assert a["gap"] == b["gap"] < 1e-5


def test_an_error_on_one_rank_stops_both_in_the_same_step(tmp_path):
    """A reward function that raises only on rank 1: both ranks raise the same one-line error
    in the same step and exit non-zero, instead of rank 0 waiting for a collective timeout."""
    out = tmp_path / "raise.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scale" / "_train.py"), "fsdp2_raise", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    while (
        not all(os.path.exists(f"{out}.rank{r}.err") for r in (0, 1))
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert time.monotonic() - start < 60
    errors = [open(f"{out}.rank{r}.err").read() for r in (0, 1)]
    assert errors[0] == errors[1]
    assert errors[0].startswith("RankError: rank 1: ScoringError: all 8 score calls")
    assert "\n" not in errors[0]

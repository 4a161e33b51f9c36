"""FSDP2 (ModelParallelStrategy + fully_shard in configure_model) equals DDP on CPU with gloo:
two ranks, each its own rollout stream, gradients averaged across ranks (tests/scale/_train.py).
Each 2-rank run is made once per module and shared by the tests that read it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from composer_lightning.engines import iter_hf_weights
from composer_lightning.models.factory import TinyLlama
from composer_lightning.models.loading import load_causal_lm
from composer_lightning.models.tiny import tiny_policy_path
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # two ranks in processes of their own


def _run(kind: str, out, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scale" / "_train.py"), kind, str(out)],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,  # a last resort: a hang fails first at the collective timeout
    )


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    """`train(kind)`: both ranks' saved records of one run of `kind`, made at most once."""
    done: dict[str, list[dict]] = {}

    def run(kind: str) -> list[dict]:
        if kind not in done:
            out = tmp_path_factory.mktemp(kind) / "run.pt"
            proc = _run(kind, out, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[kind] = [torch.load(f"{out}.rank{r}") for r in (0, 1)]
        return done[kind]

    return run


def test_fsdp2_matches_ddp_on_two_cpu_ranks(train):
    """Synthetic batches, no clipping: the averaged gradients themselves are compared."""
    ddp, fsdp = train("ddp")[0], train("fsdp2")[0]
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


def test_fsdp2_in_micro_batches_equals_fsdp2_and_syncs_once_per_step(train):
    """Rank 1 cuts its minibatches into more micro-batches than rank 0 (20- vs 60-token
    budgets): no hang, the weights are the unbatched run's, and each rank makes as many
    gradient collectives (FSDP2's reduce-scatters and all-reduces, counted) as the unbatched
    run: one reduction per optimizer step, not one per micro-batch."""
    whole, micro = train("fsdp2"), train("fsdp2_micro")
    for name, w in whole[0]["weights"].items():
        torch.testing.assert_close(micro[0]["weights"][name], w, rtol=1e-5, atol=1e-6)
    counts = [r["collectives"] for r in micro]
    assert counts == [r["collectives"] for r in whole] and counts[0] == counts[1] > 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_signal_free_update_is_skipped_on_every_rank_or_on_none(train, strategy):
    """`skip_signal_free_updates` decides on the gradient of all ranks: step 0 has signal on
    rank 0 only, and both ranks step (rank 1's own gradient was 0); steps 1 and 2 have none
    on either rank, and both leave every weight bit for bit as step 0 left it (AdamW's
    momentum would have moved them)."""
    ranks = train(f"{strategy}_flat")
    for seen in (r["seen"] for r in ranks):
        assert [s["signal_free"] for s in seen] == [0.0, 1.0, 1.0]
        after_signal, *after_flat = (s["weights"] for s in seen)
        for weights in after_flat:
            assert all(torch.equal(a, b) for a, b in zip(after_signal, weights, strict=True))


def test_fsdp2_matches_ddp_with_the_default_clip_and_canary_on_rollouts(train):
    """The rollout path with the module's defaults: every step's gradient norm (over the whole
    model, both ranks' average) is above `max_grad_norm=1.0`, so the clip binds, and equals
    DDP's; the canary gates at 1e-3 (fp32 trainer and engine) with a healthy gap. After three
    SGD steps of size ≤ 1e-3 the updates agree to 1e-7 (fp32 rounding is ≈1e-8 here), while a
    clip norm of each rank's shard alone would change them by tens of percent."""
    ddp, fsdp = train("ddp_rollout"), train("fsdp2_rollout")
    assert fsdp[0]["sharded"] and not ddp[0]["sharded"]
    for d, f in zip(ddp, fsdp, strict=True):
        assert len(d["seen"]) == len(f["seen"]) == 3
        for a, b in zip(d["seen"], f["seen"], strict=True):
            assert (a["prompts"], a["rewards"]) == (b["prompts"], b["rewards"])  # same data
            assert a["grad_norm"] > 1.0 and b["grad_norm"] > 1.0
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
            assert a["max_gap"] == b["max_gap"] == 1e-3
            assert a["gap"] < 1e-5 and b["gap"] < 1e-5
    init = {n: t.detach().clone() for n, t in iter_hf_weights(load_causal_lm(tiny_policy_path()))}
    assert ddp[0]["weights"].keys() == fsdp[0]["weights"].keys() == init.keys()
    moved = 0.0
    for name, w in ddp[0]["weights"].items():
        step = w - init[name]
        moved = max(moved, float(step.abs().max()))
        torch.testing.assert_close(fsdp[0]["weights"][name] - init[name], step, rtol=0, atol=1e-7)
    assert moved > 1e-5  # the tolerance is far below the update


@pytest.mark.parametrize(
    "kinds, frozen",
    [
        (("ddp", "fsdp2"), ("reference",)),
        (("ddp_rollout", "fsdp2_rollout"), ("reference", "teacher")),
    ],
)
def test_fsdp2_shards_the_frozen_models_and_their_kl_terms_equal_ddps(train, kinds, frozen):
    """Under FSDP2 each rank holds half the parameter bytes of the frozen reference (a copy of
    the policy) and of a separate teacher (the rollout runs), still all sharded after the last
    step (the frozen roots reshard after each forward), while DDP holds them whole; the KL
    head's metrics, from the sharded reference's log-probs, equal DDP's (an unsharded
    reference) at every step to fp32 rounding, and are not all zero (the policy moved)."""
    ddp, fsdp = train(kinds[0]), train(kinds[1])
    for name in frozen:
        d, f = [r["frozen"][name] for r in ddp], [r["frozen"][name] for r in fsdp]
        full = d[0]["full"]
        assert all(r["local"] == r["full"] == full and not r["sharded"] for r in d)
        assert all(r["full"] == full and r["sharded"] for r in f)
        assert f[0]["local"] + f[1]["local"] == full
        for r in f:  # half, up to the rows of a dimension that does not split evenly
            assert abs(r["local"] - full / 2) <= 0.01 * full
    moved = 0.0
    for d, f in zip(ddp, fsdp, strict=True):
        assert len(d["kl"]) == len(f["kl"]) == 3
        for a, b in zip(d["kl"], f["kl"], strict=True):
            assert a.keys() == b.keys() and "kl/k1_mean" in a
            for key in a:
                # fp32 rounding: after an update, DDP's and FSDP2's gradient reductions round
                # differently, so log-probs of O(1) differ by ~1e-7 and so does a mean KL of
                # O(1e-5) (seen: 1.5e-7); before the first update they are equal exactly
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), key
            moved = max(moved, abs(a["kl/k1_mean"]))
    assert moved > 1e-4


def test_fsdp2_rollouts_shard_prompts_and_keep_every_rank_engine_in_sync(train):
    """Two ranks, each with its own engine: different prompts per rank, the same weights after
    every step on both ranks, and each rank's engine in sync (canary gap ≈ 1e-6)."""
    ranks = train("fsdp2_rollout")
    seen0, seen1 = ranks[0]["seen"], ranks[1]["seen"]
    assert len(seen0) == len(seen1) == 3
    for a, b in zip(seen0, seen1, strict=True):
        assert not set(a["prompts"]) & set(b["prompts"])
        assert a["gap"] < 1e-5 and b["gap"] < 1e-5
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name])


def test_uneven_ranks_train_on_and_log_metrics_of_both_ranks(train):
    """Rank 1 scores every other sample (a constant) and has no hints: half its samples are
    dropped, an empty replay buffer (placeholder policy and reference forwards), no SDPO or OPD
    term and a placeholder teacher forward, while rank 0 has all of them; both train on, with the same weights, and the logged reward
    mean is the mean over both ranks' samples (rank 1 has fewer: a mean of the two ranks'
    means would differ)."""
    r0, r1 = (rank["seen"] for rank in train("fsdp2_uneven"))
    assert len(r0) == len(r1) == 3
    assert all(s["buffer"] == 0 for s in r1) and any(s["buffer"] > 0 for s in r0)
    for a, b in zip(r0, r1, strict=True):
        both = a["rewards"] + b["rewards"]
        assert set(b["rewards"]) == {0.5} and len(b["rewards"]) == len(a["rewards"]) // 2
        assert (
            a["reward_mean"] == b["reward_mean"] == pytest.approx(sum(both) / len(both), abs=1e-6)
        )
        assert a["gap"] == b["gap"] < 1e-5


def test_an_error_on_one_rank_stops_both_in_the_same_step(tmp_path):
    """A reward function that raises on rank 1 from the second step on: both ranks raise the
    same one-line error at global step 1 and exit non-zero, instead of rank 0 waiting in a
    collective. The run's collectives time out after 120 s, so a rank left waiting fails the
    run by itself; each rank writes its record before either exits."""
    out = tmp_path / "raise.pt"
    proc = _run("fsdp2_raise", out, timeout=900)
    assert proc.returncode != 0
    missing = [r for r in (0, 1) if not os.path.exists(f"{out}.rank{r}.err")]
    assert not missing, f"ranks {missing} did not stop with an error:\n{proc.stderr[-3000:]}"
    records = [json.loads(open(f"{out}.rank{r}.err").read()) for r in (0, 1)]
    assert records[0] == records[1]
    assert records[0]["step"] == 1
    assert records[0]["error"].startswith("RankError: rank 1: ScoringError: all 8 score calls")
    assert "\n" not in records[0]["error"]

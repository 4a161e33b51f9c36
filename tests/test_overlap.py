"""Generation overlapped with training (`max_staleness` k > 0): batches pinned to version
m − k, the off-policy correction, the canary at the generating version (and a lost push caught
at the next step, with or without overlap), and an exact resume after kill -9."""

from __future__ import annotations

from unittest import mock

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.engines.background import BackgroundEngine
from composer_lightning.engines.base import EngineContext
from composer_lightning.engines.fingerprint import FingerprintRecorder, fingerprint_mismatches
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.models.loading import load_causal_lm
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.models.weights import iter_hf_weights
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.tasks import VerifierHint
from composer_lightning.training.module import ComposerModule, OutOfSyncError
from tests.helpers import BlindLostPushEngine, LostPushEngine, quiet_trainer

pytestmark = pytest.mark.slow  # an engine process per run

POLICY = tiny_policy_path()


def _version(v: int) -> list[tuple[str, torch.Tensor]]:
    """Weight version v: the tiny policy moved by a fixed random step per version."""
    g = torch.Generator().manual_seed(v)
    model = load_causal_lm(POLICY)
    with torch.no_grad():
        for t in model.parameters():  # tied weights once, and moved together
            t.add_(0.3 * v * torch.randn(t.shape, generator=g) * t.std())
    return [(n, t.clone()) for n, t in iter_hf_weights(model)]


def test_batch_m_is_generated_by_exactly_version_m_minus_k():
    k, prompts = 2, [[1, 5, 7, 9], [2, 4, 6]]
    sampling = SamplingConfig(max_tokens=6, seed=11)
    versions = [_version(v) for v in range(6)]
    bg = BackgroundEngine(
        HFEngine(model_path=POLICY, seed=0),
        EngineContext(model_path=POLICY),
        versions[0],
        max_staleness=k,
    )
    try:
        bg.publish(versions[0], 0)
        got = {}
        for m in range(5):  # the trainer's loop: ask m … m + k, take m, train, publish m + 1
            for index in range(m, m + k + 1):
                bg.ask(index, prompts, 3, sampling)
            version, outs, seconds, engine_print = bg.take(m)
            assert version == max(0, m - k) and seconds > 0
            rec = FingerprintRecorder(versions[version], torch.float32)
            list(rec)
            assert fingerprint_mismatches(rec.fingerprint, engine_print) == (
                [],
                len(rec.fingerprint) - 1,
            )
            got[m] = outs
            weights = bg.version_weights(version)
            assert weights is not None  # readable while batch m trains
            for (name, tensor), (_, ring) in zip(versions[version], weights.items(), strict=True):
                assert torch.equal(tensor, ring), name
            bg.publish(versions[m + 1], m + 1)
            assert bg.version_weights(m + 1 - k - 1) is None  # its slot now holds m + 1
    finally:
        bg.close()
    reference = HFEngine(model_path=POLICY, seed=0)
    outputs = {}
    for m, outs in got.items():
        reference.load_weights(versions[max(0, m - k)], max(0, m - k))
        want = reference.generate(prompts, 3, sampling)
        outputs[m] = [[c.token_ids for c in row] for row in want]
        assert [[c.token_ids for c in row] for row in outs] == outputs[m], m
        for row, ref_row in zip(outs, want, strict=True):
            for c, r in zip(row, ref_row, strict=True):
                assert max(abs(a - b) for a, b in zip(c.logprobs, r.logprobs, strict=True)) < 1e-6
    assert outputs[2] != outputs[3] != outputs[4]  # the versions sample differently


def _fit(engine, k, steps, lr=1e-4, callbacks=(), **trainer_kw):
    module = ComposerModule(
        POLICY, [DrGRPOHead(), OPDHead(weight=0.5)], optimizer=lambda p: torch.optim.AdamW(p, lr=lr)
    )
    rollout = RolloutCallback(
        engine,
        group_size=4,
        sampling=SamplingConfig(max_tokens=8, seed=0),
        hint=VerifierHint(),
        samples_every_n_steps=0,
        max_staleness=k,
        hint_trust="always" if k else "knows_better",  # generated ahead: no check
    )
    seen = Metrics()
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=[rollout, seen, *callbacks],
        **({"limit_val_batches": 0} | trainer_kw),
    )
    trainer.fit(module, RolloutDataModule(tokenizer=POLICY, prompts_per_step=8))
    return module, seen.rows, trainer


class Metrics(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, *args):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_stale_batches_are_corrected_and_checked_at_their_version():
    module, rows, _ = _fit(HFEngine(seed=0), k=1, steps=5, lr=1e-3)
    assert module.policy_version == 5
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1, 1]
    assert "ppo/is_weight_mean" not in rows[0]  # batch 0 is on policy
    for r in rows[1:]:
        assert 0 < r["ppo/is_weight_mean"] <= 2.0 and r["ppo/is_weight_max"] > 0
        assert 0 <= r["ppo/is_clipped_frac"] <= 1
    # the canary compares with the generating version's recomputed log-probs: healthy is ≈1e-6
    assert max(r["rollout/logprob_gap_max"] for r in rows) < 1e-5


def test_held_out_evaluation_runs_through_the_engine_process():
    module, rows, trainer = _fit(
        HFEngine(seed=0), k=1, steps=4, val_check_interval=2, limit_val_batches=2
    )
    assert module.policy_version == 4
    assert 0 <= float(trainer.callback_metrics["val/accuracy"]) <= 1
    assert "val/pass@4" in trainer.callback_metrics


class Step(L.Callback):
    """Records the steps done: stopped at step s, the last entry is s."""

    def __init__(self):
        self.steps = [0]

    def on_train_batch_end(self, trainer, *args):
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("k,caught_at", [(0, 1), (1, 2)])
def test_a_lost_push_is_stopped_at_the_next_step_at_any_precision(k, caught_at, precision):
    """The engine claims every new version but keeps version 0's weights. On policy the first
    batch sampled by the lost version is batch 1; with k = 1 it is batch 2. The weight
    fingerprint stops it there in bf16 too, where the log-prob gap cannot (lr 1e-4)."""
    dtype = {"32-true": "float32", "bf16-mixed": "bfloat16"}[precision]
    step = Step()
    with pytest.raises(OutOfSyncError, match="does not hold the weights of policy_version 1:"):
        _fit(LostPushEngine(seed=0, dtype=dtype), k, 8, callbacks=[step], precision=precision)
    assert step.steps[-1] == caught_at


@pytest.mark.parametrize("k,caught_at", [(0, 1), (1, 2)])
def test_without_a_fingerprint_the_gap_stops_a_lost_push_in_fp32(k, caught_at):
    step = Step()
    with pytest.raises(OutOfSyncError, match=r"policy_version 1\)") as err:
        _fit(BlindLostPushEngine(seed=0), k=k, steps=8, callbacks=[step])
    assert step.steps[-1] == caught_at, err.value
    assert "max_logprob_gap=0.001" in str(err.value)  # the fp32 default


# k = 1: every batch one version stale, re-scored at the update (the larger gaps); on-policy
# runs (k = 0) check the same canary at every step of the suite's other fits
@pytest.mark.parametrize("k", [1])
def test_no_false_stop_over_200_healthy_steps(k):
    module, rows, _ = _fit(HFEngine(seed=0), k=k, steps=200)
    assert module.policy_version == 200
    worst = max(r["rollout/logprob_gap_worst_rank"] for r in rows)
    assert worst < 1e-5, worst  # two orders below the 1e-3 default


def test_overlap_refuses_an_engine_spanning_ranks():
    cb = RolloutCallback(HFEngine(model_path=POLICY), max_staleness=1)
    module = ComposerModule(POLICY, [DrGRPOHead()])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    ctx = EngineContext(world_size=2, model_path=POLICY)
    tp = mock.PropertyMock(return_value=2)
    with mock.patch.object(EngineContext, "current", return_value=ctx):
        with mock.patch.object(HFEngine, "tensor_parallel_size", tp):
            with pytest.raises(ConfigError, match="tensor_parallel_size 2 spans ranks"):
                cb.setup(trainer, module, "fit")
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0, got -1"):
        RolloutCallback(HFEngine(model_path=POLICY), max_staleness=-1)


def test_a_drawn_sampling_seed_is_saved_and_restored():
    """Without a configured seed the run's seed is drawn once (rank 0's draw on every rank) and
    checkpointed, so a resumed run samples as the interrupted one would have."""
    module = ComposerModule(POLICY, [DrGRPOHead()])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    drawn = RolloutCallback(HFEngine(model_path=POLICY), sampling=SamplingConfig(seed=None))
    drawn.setup(trainer, module, "fit")
    state = drawn.state_dict()
    assert isinstance(state["base_seed"], int)
    resumed = RolloutCallback(HFEngine(model_path=POLICY), sampling=SamplingConfig(seed=None))
    resumed.setup(trainer, module, "fit")  # draws its own, then the checkpoint's wins
    resumed.load_state_dict(state)
    assert resumed.state_dict()["base_seed"] == state["base_seed"]
    fixed = RolloutCallback(HFEngine(model_path=POLICY), sampling=SamplingConfig(seed=7))
    fixed.load_state_dict(state)  # a configured seed is the configuration's
    assert fixed.state_dict()["base_seed"] == 7


def test_overlap_under_model_parallel_strategy_on_one_device():
    """The GPU config's strategy (FSDP2 through ModelParallelStrategy), here on one CPU device:
    stale batches are checked at their version through the sharded policy's own forward (its
    parameters are DTensors); the run equals the unsharded one."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    module, rows, _ = _fit(HFEngine(seed=0), k=1, steps=4, lr=1e-3, strategy=strategy)
    assert all(hasattr(p, "full_tensor") for p in module.policy.parameters())
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert max(r["rollout/logprob_gap_max"] for r in rows) < 1e-5
    plain, _, _ = _fit(HFEngine(seed=0), k=1, steps=4, lr=1e-3)  # the same run, unsharded
    sharded = dict(iter_hf_weights(module.policy))
    for name, w in iter_hf_weights(plain.policy):
        torch.testing.assert_close(sharded[name], w, rtol=0, atol=1e-6, msg=name)

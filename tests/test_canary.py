"""The canary's verdicts: a NaN or inf where it looks stops the run as out of sync (it used to
compare as "not above the threshold"), a batch without a version stamp is checked as on
policy, and a step that compares nothing leaves no earlier figures behind."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.training.canary import OutOfSyncError, check_canary, nonfinite_loss
from composer_lightning.training.forward import score_tokens
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer, tiny_model


def _batch():
    return synthetic_batch(torch.Generator().manual_seed(0), vocab_size=64)


@pytest.mark.parametrize("side", ["engine", "trainer"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_log_prob_on_either_side_is_out_of_sync(side, bad):
    rb = _batch()
    old = torch.zeros(rb.input_ids.shape, dtype=torch.float64)
    rb.engine_logprobs = old.clone()
    b, t = torch.nonzero(rb.response_mask)[0].tolist()
    (rb.engine_logprobs if side == "engine" else old)[b, t] = bad
    with pytest.raises(OutOfSyncError, match=f"non-finite {side} log-probs on 1 of"):
        check_canary(rb, old, max_logprob_gap=None)  # even with the threshold off


def test_a_healthy_gap_passes_and_a_masked_nan_is_not_looked_at():
    rb = _batch()
    old = torch.zeros(rb.input_ids.shape, dtype=torch.float64)
    rb.engine_logprobs = old + 1e-7
    rb.engine_logprobs[~rb.response_mask] = float("nan")  # prompt and padding: not sampled
    got = check_canary(rb, old, max_logprob_gap=1e-3).local()
    assert got["rollout/logprob_gap_max"] == pytest.approx(1e-7, rel=1e-6)


def test_a_non_finite_loss_is_out_of_sync():
    assert nonfinite_loss(torch.tensor(0.3), 4) is None
    err = nonfinite_loss(torch.tensor(float("nan")), 4)
    assert isinstance(err, OutOfSyncError) and "non-finite loss nan at policy_version 4" in str(err)


def _fit(batches, **module_kw):
    module = ComposerModule(tiny_model(torch.float32), [DrGRPOHead()], **module_kw)
    rows = []

    class Rows(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    trainer = quiet_trainer(
        max_steps=len(batches),
        callbacks=[Rows()],
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return module, rows


def _engine_logprobs(rb, model, offset: float = 0.0):
    with torch.no_grad():
        lp = score_tokens(
            model, rb.input_ids, rb.attention_mask, temperature=1.0, mask=rb.response_mask
        ).logprobs
    return lp + offset


def test_unstamped_batches_are_checked_as_on_policy_and_skipped_figures_are_dropped():
    """Batch 1 carries engine log-probs 0.5 off and no version stamp, trained at policy
    version 1: checked as on policy (the gap shows) and not importance-corrected; batch 2 has
    no engine log-probs: that step compares nothing, and batch 1's figures are not shown as
    its own."""
    torch.manual_seed(0)
    batches = [_batch(), _batch(), _batch()]
    module, _ = _fit(batches[:1], max_logprob_gap=None)
    batches[1].engine_logprobs = _engine_logprobs(batches[1], module.policy, 0.5)
    _, rows = _fit(batches, max_logprob_gap=None)
    assert "rollout/logprob_gap_max" not in rows[0]
    assert rows[1]["rollout/logprob_gap_max"] == pytest.approx(0.5, abs=1e-5)
    assert "ppo/is_weight_mean" not in rows[1] and "rollout/staleness" not in rows[1]
    assert "rollout/logprob_gap_max" not in rows[2]
    assert "rollout/logprob_gap_mean" not in rows[2]


def test_nan_weights_stop_the_run_as_out_of_sync():
    """A policy whose weights went NaN: the canary sees non-finite trainer log-probs and stops
    before any update (it used to log NaN, then 0.0, and train on)."""
    model = tiny_model(torch.float32)
    rb = _batch()
    rb.engine_logprobs = _engine_logprobs(rb, model)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    module = ComposerModule(model, [DrGRPOHead()])
    trainer = quiet_trainer(
        max_steps=1,
    )
    with pytest.raises(OutOfSyncError, match="non-finite trainer log-probs"):
        trainer.fit(module, train_dataloaders=DataLoader([rb], batch_size=None))
    assert trainer.global_step == 0


def test_a_batch_of_mixed_versions_is_compared_on_the_rows_these_weights_sampled():
    """Serve's batches mix versions (stamped stale, no recomputed rows): the rows the current
    weights sampled (`on_policy_rows`) are compared with the trainer's log-probs, the older
    rows (whose engine log-probs are another version's) are not; an engine out of sync on
    such a row stops the run, and with no row marked nothing is compared."""
    rb = _batch()
    old = torch.zeros(rb.input_ids.shape, dtype=torch.float64)
    rb.engine_logprobs = old + 1e-7
    rows = torch.zeros(rb.batch_size, dtype=torch.bool)
    rows[::2] = True
    rb.engine_logprobs[~rows] = -3.0  # older weights' log-probs: far from the trainer's
    rb.on_policy_rows = rows
    got = check_canary(rb, old, max_logprob_gap=1e-3, stale=True).local()
    assert got["rollout/logprob_gap_max"] == pytest.approx(1e-7, rel=1e-6)
    assert got["rollout/logprob_gap_mean"] == pytest.approx(1e-7, rel=1e-6)
    b = int(torch.nonzero(rows)[0])
    t = int(torch.nonzero(rb.response_mask[b])[0])
    rb.engine_logprobs[b, t] = 0.5  # the engine's own row disagrees: out of sync
    with pytest.raises(OutOfSyncError, match="out of sync"):
        check_canary(rb, old, max_logprob_gap=1e-3, stale=True)
    rb.on_policy_rows = torch.zeros_like(rows)
    assert check_canary(rb, old, max_logprob_gap=1e-3, stale=True).local() == {}


@pytest.mark.parametrize(
    ("trainer", "engine", "threshold"),
    [
        ("32-true", "float32", 1e-3),
        ("64-true", "float64", 1e-3),
        ("32-true", "bfloat16", 0.2),  # SmolLM2's worst step 0.054 here
        ("bf16-mixed", "float32", 0.2),  # 0.065
        ("bf16-mixed", "bfloat16", 0.2),  # 0.036
        ("32-true", None, 0.2),  # an engine that does not say: not assumed exact
    ],
)
def test_the_default_threshold_follows_both_sides_precision(trainer, engine, threshold):
    """fp32 on both sides: 1e-3; bf16 on either side: 0.2, above SmolLM2's measured healthy
    gaps (`bench/precision_gap.py`), which the 0.05 before stopped."""
    from composer_lightning.training.canary import default_max_logprob_gap

    assert default_max_logprob_gap(trainer, engine) == threshold

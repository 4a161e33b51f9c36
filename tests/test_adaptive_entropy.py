"""`model.adaptive_entropy`: the entropy bonus's coefficient steered by the measured entropy as
TRL's `use_adaptive_entropy` steers it, measured over every token the bonus acts on, saved in
checkpoints, and set from the command line."""

from __future__ import annotations

import glob
import math

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.training.entropy import AdaptiveEntropy, EntropyControl
from composer_lightning.training.module import ComposerModule
from tests.helpers import ROOT, quiet_trainer, run_cli, tiny_model


def trl_controller(entropies, coef, target, delta, coef_min, coef_max):
    """TRL 1.16 `GRPOTrainer._compute_loss` (grpo_trainer.py:3206-3239) for one micro-batch per
    optimizer step: the coefficient applied at each step, and the coefficient after it."""
    last_world_entropy = float("inf")
    applied, after = [], []
    for world_entropy in entropies:
        applied.append(coef if last_world_entropy <= target else 0.0)
        if world_entropy <= target:
            coef = min(coef + delta, coef_max)
        else:
            coef = max(coef - delta, coef_min)
        last_world_entropy = world_entropy
        after.append(coef)
    return applied, after


def test_the_controller_equals_trls_and_a_hand_sequence():
    """target 0.2, delta 0.1, bounds [0, 0.25], from 0.05; entropies 0.5, 0.1, 0.1, 0.3, 0.05:
    applied 0 (nothing measured yet), 0 (0.5 > target), 0.1, 0.2, 0 (0.3 > target); the
    coefficient after each step 0, 0.1, 0.2, 0.1, 0.2."""
    entropies = [0.5, 0.1, 0.1, 0.3, 0.05]
    control = EntropyControl(AdaptiveEntropy(0.2, 0.1, 0.0, 0.25), 0.05)
    applied, after = [], []
    for e in entropies:
        applied.append(control.applied())
        control.update(e)
        after.append(control.coef)
    want = trl_controller(entropies, 0.05, 0.2, 0.1, 0.0, 0.25)
    assert applied == pytest.approx(want[0], abs=1e-15) and after == pytest.approx(
        want[1], abs=1e-15
    )
    assert applied == pytest.approx([0, 0, 0.1, 0.2, 0], abs=1e-15)
    assert after == pytest.approx([0, 0.1, 0.2, 0.1, 0.2], abs=1e-15)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"delta": 0.0}, "adaptive_entropy.delta must be > 0, got 0.0"),
        ({"coef_min": 0.5, "coef_max": 0.1}, "coef_min <= coef_max, got coef_min=0.5"),
        ({"target": math.nan}, "must be finite"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveEntropy(**kwargs)


class Steered(L.Callback):
    """The measured entropy (the step's logged `entropy`) and the controller after each step."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, *args):
        control = module.objective.entropy_control
        self.seen.append((float(trainer.callback_metrics["entropy"]), control.last, control.coef))


def _module():
    return ComposerModule(
        tiny_model(torch.float64),
        [DrGRPOHead()],
        entropy_coef=0.01,
        adaptive_entropy=AdaptiveEntropy(target=10.0, delta=0.02, coef_max=0.05),
        max_logprob_gap=None,
    )


def test_the_module_steers_by_the_measured_entropy_and_resumes_with_it(tmp_path):
    """Entropies of the tiny model (≈ 4 nats) are under a target of 10: the coefficient rises
    0.01 → 0.03 → 0.05 (its bound). A run resumed from step 2 continues from 0.05 and the
    measured entropy, not from the configured 0.01."""
    module, steered = _module(), Steered()
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    quiet_trainer(max_steps=3, callbacks=[steered, saver]).fit(
        module, SyntheticRolloutDataModule(vocab_size=64)
    )
    for measured, last, _ in steered.seen:
        assert last == pytest.approx(measured, rel=1e-6)  # the bonus tokens: every response token
    assert [round(c, 12) for *_, c in steered.seen] == [0.03, 0.05, 0.05]
    (ckpt,) = glob.glob(str(tmp_path / "*step=2*.ckpt"))
    resumed = _module()
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint["composer"]["entropy_control"]["coef"] == pytest.approx(0.05)
    resumed.on_load_checkpoint(checkpoint)
    control = resumed.objective.entropy_control
    assert (control.coef, control.last) == pytest.approx((0.05, steered.seen[1][1]))


@pytest.mark.slow  # a fit through the command line
def test_adaptive_entropy_from_the_command_line(tmp_path):
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "synthetic_demo.yaml"),
        "--trainer.max_steps=2",
        "--model.entropy_coef=0.01",
        "--model.adaptive_entropy.target=10.0",
        "--model.adaptive_entropy.delta=0.02",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (metrics,) = glob.glob(str(tmp_path / "synthetic_demo" / "*" / "metrics.csv"))
    assert "entropy_coef" in open(metrics).read()


def test_the_loss_takes_the_applied_coefficient():
    """Before any measurement the bonus is off (TRL: the last entropy is +inf); after an
    entropy under target it is `coef · H`, H the token mean here."""
    from composer_lightning.training.objective import Objective
    from tests.test_surrogate_options import _batch, _ctx, make_inputs

    lp, old, _, mask, ent = make_inputs()
    objective = Objective(
        [DrGRPOHead()],
        aggregation="token_mean",
        entropy_coef=0.3,
        adaptive_entropy=AdaptiveEntropy(target=5.0, delta=0.1),
        importance_cap=None,
    )
    plain = Objective([DrGRPOHead()], aggregation="token_mean", importance_cap=None)
    batch = _batch(mask)
    base, _ = plain(batch, _ctx(lp, old, ent), {"dr_grpo": 1.0})
    first, metrics = objective(batch, _ctx(lp, old, ent), {"dr_grpo": 1.0})
    assert first.item() == pytest.approx(base.item(), abs=1e-12) and metrics["entropy_coef"] == 0
    objective.end_step()  # H ≈ 1 < 5: the coefficient rises to 0.4 and is applied
    second, metrics = objective(batch, _ctx(lp, old, ent), {"dr_grpo": 1.0})
    h = float(ent[mask].mean())
    assert metrics["entropy_coef"] == pytest.approx(0.4)
    assert second.item() == pytest.approx(base.item() - 0.4 * h, abs=1e-12)

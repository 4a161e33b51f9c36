"""ComposerModule on a tiny random model with hand-made batches."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import composer_lightning.module as module_lib
from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.module import ComposerModule
from tests.helpers import ScriptedTeacher, one_sample_batch, teacher_logits_for, tiny_model

PROMPT, RESPONSE, HINT = [5, 9, 11], [20, 21, 22, 23], [40, 41]
DELTA = torch.tensor([0.2, 0.9, 0.0, 0.6], dtype=torch.float64)


def _fit_one(module: ComposerModule, batch) -> dict[str, float]:
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("has_teacher,has_reward,expected", [
    (True, True, [1.2, 1.9, 1.0, 1.6]),   # OPD+RL
    (True, False, [0.2, 0.9, 0.0, 0.6]),  # OPD-only
    (False, True, [1.0, 1.0, 1.0, 1.0]),  # RL-only
])
def test_worked_example_through_the_full_path(has_teacher, has_reward, expected, monkeypatch):
    """The seeds' example, G = 1: teacher log-probs = old + [0.2, 0.9, 0.0, 0.6], reward +1.

    With the ratio exactly 1 the clip never binds, so per token l = −A and `token_sum_norm`
    gives loss = −Σ_t A_t / (B · norm_length) = −Σ A / 4; e.g. OPD+RL: −5.7 / 4 = −1.425.
    """
    policy = tiny_model()
    batch = one_sample_batch(PROMPT, RESPONSE, HINT, reward=1.0, has_reward=has_reward,
                             has_teacher=has_teacher)
    with torch.no_grad():
        from composer_lightning.functional import logprobs_from_logits
        from composer_lightning.step import forward_logits
        old = logprobs_from_logits(forward_logits(policy, batch.input_ids, batch.attention_mask),
                                   batch.input_ids)[0, len(PROMPT):]
    logits = teacher_logits_for(old + DELTA, batch.teacher_input_ids, len(PROMPT) + len(HINT), 64)
    teacher = ScriptedTeacher(batch.teacher_input_ids, logits)
    module = ComposerModule(policy, [DrGRPOHead(), OPDHead()], teacher=teacher,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    seen = []
    real = module_lib.policy_loss

    def spy(lp, old_, adv, mask, **kw):
        out = real(lp, old_, adv, mask, **kw)
        seen.append((adv.clone(), (lp - old_).detach(), out[0].detach()))
        return out
    monkeypatch.setattr(module_lib, "policy_loss", spy)
    metrics = _fit_one(module, batch)
    (adv, log_ratio, loss), = seen
    assert teacher.calls == 1  # one teacher forward, shared
    torch.testing.assert_close(adv[0, len(PROMPT):], torch.tensor(expected, dtype=torch.float64),
                               rtol=0, atol=1e-10)
    assert torch.all(adv[0, :len(PROMPT)] == 0)
    assert torch.all(log_ratio == 0)
    assert float(loss) == pytest.approx(-sum(expected) / 4, abs=1e-12)
    assert metrics["train/loss"] == pytest.approx(-sum(expected) / 4, abs=1e-6)  # logged as fp32


def _grads(module: ComposerModule, batch) -> dict[str, torch.Tensor]:
    weights = {h.name: h.effective_weight(0) for h in module.heads}
    needs = set().union(*(h.requires for h in module.heads if weights[h.name] > 0))
    module.policy.zero_grad()
    ctx = module._context(batch, None, needs)
    module.heads[-1].on_rollout(batch, ctx.old_logprobs) if hasattr(module.heads[-1], "buffer") else None
    loss, _ = module._objective(batch, ctx, weights)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.policy.named_parameters()}


@pytest.mark.parametrize("zero_head", [
    OPDHead(weight=0.0), SDPOHead(weight=0.0), SDPOHead(weight=1.0, warmup_steps=10),
    KLHead(kl_coef=0.0, estimator="k3", placement="loss", name="kl_loss"), ReplayDPOHead(weight=0.0),
])
def test_zero_weight_head_changes_no_gradient_bit_for_bit(zero_head):
    batch = synthetic_batch(torch.Generator().manual_seed(1), vocab_size=64)
    base = tiny_model()
    with_zero = ComposerModule(copy.deepcopy(base), [DrGRPOHead(), KLHead(kl_coef=0.1), zero_head],
                               reference=copy.deepcopy(base))
    without = ComposerModule(copy.deepcopy(base), [DrGRPOHead(), KLHead(kl_coef=0.1)],
                             reference=copy.deepcopy(base))
    g1, g2 = _grads(with_zero, batch), _grads(without, batch)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_dispatch_flags_zero_each_signal_exactly_with_groups():
    """G = 4: unrewarded samples get exactly 0 RL advantage (their reward value is ignored),
    unhinted samples exactly 0 OPD advantage."""
    batch = synthetic_batch(torch.Generator().manual_seed(3), prompts=3, group_size=4, vocab_size=64)
    batch.rewards[~batch.has_reward] = 1e6  # must not leak anywhere
    module = ComposerModule(tiny_model(), [DrGRPOHead(), OPDHead()])
    ctx = module._context(batch, None, {"teacher_logprobs"})
    rl = module.heads[0].compute(batch, ctx).advantages
    opd = module.heads[1].compute(batch, ctx).advantages
    assert torch.all(rl[~batch.has_reward] == 0) and torch.all(opd[~batch.has_teacher] == 0)
    assert torch.all(rl[~batch.response_mask] == 0) and torch.all(opd[~batch.response_mask] == 0)
    assert (rl[batch.has_reward].abs() < 10).all()
    assert (opd[batch.has_teacher & batch.response_mask.any(1)] != 0).any()
    per_sample = rl.sum(1) / batch.response_mask.sum(1)  # the broadcast value
    for g in torch.unique(batch.group_ids):
        m = (batch.group_ids == g) & batch.has_reward
        if m.sum() > 1:
            assert abs(float(per_sample[m].sum())) < 1e-9


def _two_epoch_losses(mixing: str) -> list[float]:
    """Rewards push one way, the hinted teacher the other: the two terms have opposite signs."""
    torch.manual_seed(0)
    batch = synthetic_batch(torch.Generator().manual_seed(5), prompts=2, group_size=4,
                            vocab_size=64, hint_prob=1.0, reward_prob=1.0)
    module = ComposerModule(tiny_model(seed=2), [DrGRPOHead(weight=1.0), OPDHead(weight=3.0)],
                            teacher=tiny_model(seed=9), mixing=mixing, ppo_epochs=2,
                            optimizer=lambda p: torch.optim.SGD(p, lr=5.0), max_grad_norm=None,
                            aggregation="token_mean")
    losses = []
    real = module_lib.policy_loss

    def spy(*a, **kw):
        out = real(*a, **kw)
        losses.append((float(out[1]["clipfrac"]), float(out[0])))
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module_lib, "policy_loss", spy)
        _fit_one(module, batch)
    return losses


def test_mixing_loss_equals_advantage_at_ratio_one_and_differs_where_clip_binds():
    adv_calls = _two_epoch_losses("advantage")
    loss_calls = _two_epoch_losses("loss")
    # epoch 1: ratio 1, the surrogate is linear in A, so Σ per-term surrogates = mixed surrogate
    first_adv = adv_calls[0][1]
    first_loss = loss_calls[0][1] + loss_calls[1][1]
    assert first_adv == pytest.approx(first_loss, abs=1e-9)
    # epoch 2: the clip binds and the terms have opposite signs → the two objectives differ
    assert adv_calls[1][0] > 0  # clipfrac > 0 in the second epoch
    second_adv = adv_calls[1][1]
    second_loss = loss_calls[3][1] + loss_calls[4][1]
    assert abs(second_adv - second_loss) > 1e-4


def test_variance_matching_rescales_each_term_to_the_reference_sigma():
    batch = synthetic_batch(torch.Generator().manual_seed(7), prompts=3, group_size=4, vocab_size=64,
                            hint_prob=0.7)
    module = ComposerModule(tiny_model(), [DrGRPOHead(), OPDHead(weight=2.0)], teacher=tiny_model(seed=3),
                            variance_matching="dr_grpo")
    weights = {"dr_grpo": 1.0, "opd": 2.0}
    ctx = module._context(batch, None, {"teacher_logprobs"})
    _, metrics = module._objective(batch, ctx, weights)
    rl = module.heads[0].compute(batch, ctx)
    opd = module.heads[1].compute(batch, ctx)
    s_rl = rl.advantages[rl.active_mask].std(unbiased=False)
    s_opd = opd.advantages[opd.active_mask].std(unbiased=False)
    assert metrics["dr_grpo/weight"] == 1.0
    assert metrics["opd/weight"] == pytest.approx(2.0 * float(s_rl / s_opd), rel=1e-12)


def test_variance_matching_keeps_the_weight_of_a_constant_term():
    batch = synthetic_batch(torch.Generator().manual_seed(7), vocab_size=64)
    batch.rewards[:] = 1.0  # every group constant: σ(dr_grpo) = 0
    module = ComposerModule(tiny_model(), [DrGRPOHead(weight=0.5), OPDHead()], variance_matching="opd")
    ctx = module._context(batch, None, {"teacher_logprobs"})
    _, metrics = module._objective(batch, ctx, {"dr_grpo": 0.5, "opd": 1.0})
    assert metrics["dr_grpo/weight"] == 0.5


def test_entropy_bonus_subtracts_coef_times_aggregated_entropy():
    batch = synthetic_batch(torch.Generator().manual_seed(2), vocab_size=64)
    base = tiny_model()
    plain = ComposerModule(copy.deepcopy(base), [DrGRPOHead()])
    bonus = ComposerModule(copy.deepcopy(base), [DrGRPOHead()], entropy_coef=0.01)
    l0, _ = plain._objective(batch, plain._context(batch, None, set()), {"dr_grpo": 1.0})
    ctx = bonus._context(batch, None, set())
    l1, metrics = bonus._objective(batch, ctx, {"dr_grpo": 1.0})
    expected = l0 - 0.01 * ctx.aggregate(ctx.entropy, batch.response_mask)
    torch.testing.assert_close(l1, expected, rtol=0, atol=1e-12)
    assert "entropy" in metrics


def test_minibatches_split_along_groups_and_recompute_old_logprobs():
    """Two minibatches: the first update sees ratio exactly 1 (old = recomputed before any
    update), the second sees the first update's effect (ratio ≠ 1)."""
    batch = synthetic_batch(torch.Generator().manual_seed(8), prompts=4, group_size=2, vocab_size=64,
                            reward_prob=1.0)
    module = ComposerModule(tiny_model(), [DrGRPOHead()], minibatches=2,
                            optimizer=lambda p: torch.optim.SGD(p, lr=1.0), max_grad_norm=None)
    parts = module._minibatch_indices(batch)
    assert len(parts) == 2
    for part in parts:  # no group is split
        groups = set(batch.group_ids[part].tolist())
        assert all(set(torch.nonzero(batch.group_ids == g).flatten().tolist()) <= set(part.tolist())
                   for g in groups)
    seen = []
    real = module_lib.policy_loss

    def spy(lp, old, *a, **kw):
        seen.append(float((lp - old).abs().max()))
        return real(lp, old, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module_lib, "policy_loss", spy)
        _fit_one(module, batch)
    assert seen[0] == 0.0 and seen[1] > 1e-6
    with pytest.raises(ValueError, match="minibatches=5 but the batch has only 4 groups"):
        ComposerModule(tiny_model(), [DrGRPOHead()], minibatches=5)._minibatch_indices(batch)

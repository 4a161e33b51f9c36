"""ComposerModule and the public Objective on a tiny random model with hand-made batches.

Why this file is long: every test here drives the module's one training step (or the
objective it calls) on the same hand-made batches and helpers; split by topic, each part would
import the same fixtures."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.functional import logprobs_from_logits
from composer_lightning.heads.base import Head
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.protocols.step import StepContext
from composer_lightning.training.module import ComposerModule
from composer_lightning.training.objective import Objective
from tests.helpers import (
    Fixed,
    ScriptedTeacher,
    context,
    full_logits,
    one_sample_batch,
    quiet_trainer,
    teacher_logits_for,
    tiny_model,
)

PROMPT, RESPONSE, HINT = [5, 9, 11], [20, 21, 22, 23], [40, 41]
DELTA = torch.tensor([0.2, 0.9, 0.0, 0.6], dtype=torch.float64)


def _fit(module: ComposerModule, batch, callbacks=()) -> dict[str, float]:
    trainer = quiet_trainer(
        max_steps=module.ppo_epochs * module.minibatches,
        callbacks=list(callbacks),
    )
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


class Recording(Head):
    """Wraps a head and records, per update, its advantages and the ratio's log."""

    def __init__(self, inner: Head):
        super().__init__(name=inner.name, weight=inner.weight, schedule=inner.schedule)
        self.inner, self.requires = inner, inner.requires
        self.seen: list[dict[str, torch.Tensor]] = []

    def compute(self, batch, ctx):
        out = self.inner.compute(batch, ctx)
        self.seen.append(
            {
                "adv": None if out.advantages is None else out.advantages.clone(),
                "loss": None if out.loss is None else out.loss.detach().clone(),
                "log_ratio": (ctx.logprobs - ctx.old_logprobs).detach().clone(),
                "teacher_logits": ctx.teacher_logits.detach().clone()
                if ctx.has("teacher_hidden")
                else None,
            }
        )
        return out


@pytest.mark.parametrize(
    "has_teacher,has_reward,expected",
    [
        (True, True, [1.2, 1.9, 1.0, 1.6]),  # OPD+RL
        (True, False, [0.2, 0.9, 0.0, 0.6]),  # OPD-only
        (False, True, [1.0, 1.0, 1.0, 1.0]),  # RL-only
    ],
)
def test_worked_example_through_the_full_path(has_teacher, has_reward, expected):
    """The seeds' example, G = 1: teacher log-probs = old + [0.2, 0.9, 0.0, 0.6], reward +1.

    With the ratio exactly 1 the clip never binds, so per token l = −A and `token_sum_norm`
    gives loss = −Σ_t A_t / (B · norm_length) = −Σ A / 4; e.g. OPD+RL: −5.7 / 4 = −1.425.
    """
    policy = tiny_model()
    batch = one_sample_batch(
        PROMPT, RESPONSE, HINT, reward=1.0, has_reward=has_reward, has_teacher=has_teacher
    )
    with torch.no_grad():
        old = logprobs_from_logits(
            full_logits(policy, batch.input_ids, batch.attention_mask), batch.input_ids
        )[0, len(PROMPT) :]
    logits = teacher_logits_for(old + DELTA, batch.teacher_input_ids, len(PROMPT) + len(HINT), 64)
    teacher = ScriptedTeacher(batch.teacher_input_ids, logits)
    module = ComposerModule(  # the seed's combine as it is: the plain gap, uncapped
        policy,
        [DrGRPOHead(), OPDHead(center=None)],
        teacher=teacher,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
        teacher_cap=None,
    )
    obj, ctx = module.objective, context(module, batch)
    weights = obj.weights(0)
    terms = obj.advantage_terms(batch, obj.head_outputs(batch, ctx, weights), weights)
    mixed = sum(t.weight * t.advantages for t in terms)
    torch.testing.assert_close(
        mixed[0, len(PROMPT) :], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-10
    )
    assert torch.all(mixed[0, : len(PROMPT)] == 0) and torch.all(ctx.logprobs == ctx.old_logprobs)
    loss, _ = obj(batch, ctx, weights)
    assert float(loss) == pytest.approx(-sum(expected) / 4, abs=1e-12)
    teacher.calls = 0
    metrics = _fit(module, batch)
    assert teacher.calls == 1  # one teacher forward, shared
    assert metrics["train/loss"] == pytest.approx(-sum(expected) / 4, abs=1e-6)  # logged as fp32


def _grads(module: ComposerModule, batch) -> dict[str, torch.Tensor]:
    weights = module.objective.weights(0)
    module.policy.zero_grad()
    ctx = context(module, batch)
    for head in module.heads:
        head.on_rollout(batch, ctx.old_logprobs)
    loss, _ = module.objective(batch, ctx, weights)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.policy.named_parameters()}


@pytest.mark.parametrize(
    "zero_head",
    [
        OPDHead(weight=0.0),
        SDPOHead(weight=0.0),
        SDPOHead(weight=1.0, warmup_steps=10),
        KLHead(kl_coef=0.0, estimator="k3", placement="loss", name="kl_loss"),
        ReplayDPOHead(weight=0.0),
    ],
)
def test_zero_weight_head_changes_no_gradient_bit_for_bit(zero_head):
    batch = synthetic_batch(torch.Generator().manual_seed(1), vocab_size=64)
    base = tiny_model()
    with_zero = ComposerModule(
        copy.deepcopy(base),
        [DrGRPOHead(), KLHead(kl_coef=0.1), zero_head],
        reference=copy.deepcopy(base),
    )
    without = ComposerModule(
        copy.deepcopy(base), [DrGRPOHead(), KLHead(kl_coef=0.1)], reference=copy.deepcopy(base)
    )
    g1, g2 = _grads(with_zero, batch), _grads(without, batch)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_dispatch_flags_zero_each_signal_exactly_with_groups():
    """G = 4: unrewarded samples get exactly 0 RL advantage (their reward value is ignored),
    unhinted samples exactly 0 OPD advantage."""
    batch = synthetic_batch(
        torch.Generator().manual_seed(3), prompts=3, group_size=4, vocab_size=64
    )
    batch.rewards[~batch.has_reward] = 1e6  # must not leak anywhere
    module = ComposerModule(tiny_model(), [DrGRPOHead(), OPDHead()])
    ctx = context(module, batch)
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


# ---------------------------------------------------------------- the objective, by hand


def _ctx(logprobs, old, mask, aggregation="token_mean"):
    return StepContext(
        global_step=0,
        logprobs=logprobs,
        old_logprobs=old,
        aggregation=aggregation,
        norm_length=mask.shape[1],
        temperature=1.0,
    )


def _surrogate_by_hand(lp, old, adv, mask, lo=0.2, hi=0.28) -> float:
    """token_mean of max(−r·A, −clip(r)·A), a scalar loop in float64."""
    total, n = 0.0, 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t]:
                r = float(torch.exp(lp[b, t] - old[b, t]))
                a = float(adv[b, t])
                total += max(-r * a, -min(max(r, 1 - lo), 1 + hi) * a)
                n += 1
    return total / n


def _objective_case():
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    mask = torch.rand(B, T, generator=g) < 0.8
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)  # ratios in e^±0.5
    a1 = torch.randn(B, T, generator=g, dtype=torch.float64)
    a2 = -2.0 * a1 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # opposite signs
    batch = synthetic_batch(
        g,
        prompts=1,
        group_size=B,
        prompt_length=2,
        response_length=T - 2,
        vocab_size=64,
        reward_prob=1.0,
    )
    batch.response_mask = mask
    return batch, lp, old, a1, a2, mask


def test_loss_mixing_equals_the_sum_of_per_term_surrogates_by_hand():
    """`mixing: loss` = Σ_i token_mean(max(−r·w_i·A_i, −clip(r)·w_i·A_i)); `advantage` mixes
    first. Where the clip binds and the terms disagree in sign the two differ."""
    batch, lp, old, a1, a2, mask = _objective_case()
    heads = lambda: [Fixed("one", a1, weight=1.0), Fixed("two", a2, weight=0.5)]  # noqa: E731
    ctx = _ctx(lp.clone().requires_grad_(), old, mask)
    per_term = Objective(heads(), aggregation="token_mean", mixing="loss")
    loss, _ = per_term(batch, ctx, {"one": 1.0, "two": 0.5})
    expected = _surrogate_by_hand(lp, old, a1 * mask, mask) + _surrogate_by_hand(
        lp, old, 0.5 * a2 * mask, mask
    )
    assert float(loss) == pytest.approx(expected, abs=1e-12)
    mixed = Objective(heads(), aggregation="token_mean", mixing="advantage")
    loss_mixed, metrics = mixed(batch, ctx, {"one": 1.0, "two": 0.5})
    assert float(loss_mixed) == pytest.approx(
        _surrogate_by_hand(lp, old, (a1 + 0.5 * a2) * mask, mask), abs=1e-12
    )
    assert metrics["ppo/clipfrac"] > 0 and abs(float(loss_mixed) - expected) > 1e-3


def test_variance_matching_scales_the_advantages_that_reach_the_surrogate():
    """The surrogate must see σ(ref)/σ(term)-scaled advantages: at ratio 1 with token_mean the
    loss is −mean(Σ w_i s_i A_i) over the response tokens, computed here by hand."""
    batch, lp, _, a1, a2, mask = _objective_case()
    ctx = _ctx(lp.clone().requires_grad_(), lp, mask)
    obj = Objective(
        [Fixed("one", a1), Fixed("two", a2, weight=2.0)],
        aggregation="token_mean",
        variance_matching="one",
    )
    loss, metrics = obj(batch, ctx, {"one": 1.0, "two": 2.0})
    s = float(a1[mask].std(unbiased=False) / a2[mask].std(unbiased=False))
    expected = -float(((a1 + 2.0 * s * a2) * mask).sum() / mask.sum())
    assert float(loss) == pytest.approx(expected, abs=1e-12)
    assert metrics["two/weight"] == pytest.approx(2.0 * s, rel=1e-12)
    assert abs(expected + float(((a1 + 2.0 * a2) * mask).sum() / mask.sum())) > 1e-3  # it matters


def test_variance_matching_keeps_the_weight_of_a_constant_term():
    batch = synthetic_batch(torch.Generator().manual_seed(7), vocab_size=64)
    batch.rewards[:] = 1.0  # every group constant: σ(dr_grpo) = 0
    module = ComposerModule(
        tiny_model(), [DrGRPOHead(weight=0.5), OPDHead()], variance_matching="opd"
    )
    _, metrics = module.objective(batch, context(module, batch), {"dr_grpo": 0.5, "opd": 1.0})
    assert metrics["dr_grpo/weight"] == 0.5


def test_entropy_bonus_subtracts_coef_times_aggregated_entropy():
    batch = synthetic_batch(torch.Generator().manual_seed(2), vocab_size=64)
    base = tiny_model()
    plain = ComposerModule(copy.deepcopy(base), [DrGRPOHead()])
    bonus = ComposerModule(copy.deepcopy(base), [DrGRPOHead()], entropy_coef=0.01)
    l0, _ = plain.objective(batch, context(plain, batch), {"dr_grpo": 1.0})
    ctx = context(bonus, batch)
    l1, metrics = bonus.objective(batch, ctx, {"dr_grpo": 1.0})
    expected = l0 - 0.01 * ctx.aggregate(ctx.entropy, batch.response_mask)
    torch.testing.assert_close(l1, expected, rtol=0, atol=1e-12)
    assert "entropy" in metrics


# ---------------------------------------------------------------- updates per rollout batch
def test_minibatches_split_along_groups_and_recompute_old_logprobs():
    """Two minibatches: the first update sees ratio exactly 1 (old = recomputed before any
    update), the second sees the first update's effect (ratio ≠ 1)."""
    batch = synthetic_batch(
        torch.Generator().manual_seed(8), prompts=4, group_size=2, vocab_size=64, reward_prob=1.0
    )
    head = Recording(DrGRPOHead())
    module = ComposerModule(
        tiny_model(),
        [head],
        minibatches=2,
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        max_grad_norm=None,
    )
    parts = batch.group_splits(module.minibatches)
    assert len(parts) == 2
    for part in parts:  # no group is split
        groups = set(batch.group_ids[part].tolist())
        assert all(
            set(torch.nonzero(batch.group_ids == g).flatten().tolist()) <= set(part.tolist())
            for g in groups
        )
    _fit(module, batch)
    first, second = (float(s["log_ratio"].abs().max()) for s in head.seen)
    assert first == 0.0 and second > 1e-6
    with pytest.raises(ValueError, match="minibatches=5 but the batch has only 4 groups"):
        batch.group_splits(5)


def test_teacher_and_kl_terms_are_fixed_for_the_whole_rollout_batch():
    """2 epochs × 2 minibatches with the live policy as teacher and KL in the advantage: the
    OPD and KL advantage terms of each minibatch are identical in all its updates and equal
    the values computed before any update, although the policy moves in between."""
    batch = synthetic_batch(
        torch.Generator().manual_seed(9),
        prompts=4,
        group_size=2,
        vocab_size=64,
        reward_prob=1.0,
        hint_prob=1.0,
    )
    base = tiny_model()
    opd, kl = Recording(OPDHead()), Recording(KLHead(kl_coef=0.5))
    module = ComposerModule(
        copy.deepcopy(base),
        [DrGRPOHead(), opd, kl],
        reference=tiny_model(seed=4),
        ppo_epochs=2,
        minibatches=2,
        max_grad_norm=None,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
    )
    parts = batch.group_splits(module.minibatches)
    before = ComposerModule(
        copy.deepcopy(base), [OPDHead(), KLHead(kl_coef=0.5)], reference=tiny_model(seed=4)
    )
    expected = []
    for idx in parts:  # each minibatch on the untouched policy
        mb = batch.select(idx)
        ctx = context(before, mb)
        expected.append(
            (
                before.heads[0].compute(mb, ctx).advantages,
                before.heads[1].compute(mb, ctx).advantages,
            )
        )
    _fit(module, batch)
    assert len(opd.seen) == len(kl.seen) == 4
    assert any(float(s["log_ratio"].abs().max()) > 1e-4 for s in opd.seen)  # the policy moved
    for update in range(4):
        exp_opd, exp_kl = expected[update % 2]
        torch.testing.assert_close(opd.seen[update]["adv"], exp_opd, rtol=0, atol=1e-12)
        torch.testing.assert_close(kl.seen[update]["adv"], exp_kl, rtol=0, atol=1e-12)
        assert torch.any(exp_opd != 0) and torch.any(exp_kl != 0)


def test_sdpo_teacher_is_fixed_across_updates():
    """No hint (teacher context = student context) and the live policy as teacher: the first
    update's JSD is exactly 0; later ones are > 0 only because the teacher stays the policy of
    before the first update (a teacher recomputed from the updated policy would give 0 again)."""
    batch = synthetic_batch(
        torch.Generator().manual_seed(10),
        prompts=2,
        group_size=2,
        vocab_size=64,
        hint_length=0,
        hint_prob=1.0,
        reward_prob=1.0,
    )
    sdpo = Recording(SDPOHead(clip=None))
    module = ComposerModule(
        tiny_model(),
        [DrGRPOHead(), sdpo],
        ppo_epochs=3,
        max_grad_norm=None,
        optimizer=lambda p: torch.optim.SGD(p, lr=2.0),
    )
    policy0 = copy.deepcopy(module.policy)
    _fit(module, batch)
    jsd = [float(s["loss"]) for s in sdpo.seen]
    assert len(jsd) == 3 and abs(jsd[0]) < 1e-12 and jsd[1] > 1e-8 and jsd[2] > 1e-8
    with torch.no_grad():  # the pre-update policy's logits predicting each token
        logits0 = full_logits(policy0, batch.input_ids, batch.attention_mask)
    mask = batch.sdpo_mask
    for s in sdpo.seen:
        torch.testing.assert_close(
            s["teacher_logits"][:, 1:][mask[:, 1:]],
            logits0[:, :-1][mask[:, 1:]],
            rtol=0,
            atol=1e-10,
        )


@pytest.mark.parametrize("skip", [False, True])
def test_an_update_without_signal_moves_the_weights_only_along_adams_momentum(skip):
    """A step with signal, then two whose groups all have equal rewards (Dr. GRPO's gradient
    exactly 0): AdamW moves the weights on along its momentum unless
    `skip_signal_free_updates`, which leaves them bit for bit as the signal step left them.
    `train/signal_free` says which updates had no signal."""
    g = torch.Generator().manual_seed(3)
    signal = synthetic_batch(g, vocab_size=64, reward_prob=1.0)
    flat = [synthetic_batch(g, vocab_size=64, reward_prob=1.0) for _ in range(2)]
    for batch in flat:
        batch.rewards = torch.ones_like(batch.rewards)  # every group: equal rewards
    module = ComposerModule(
        tiny_model(),
        [DrGRPOHead()],
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        skip_signal_free_updates=skip,
    )
    seen: list[tuple[float, dict[str, torch.Tensor]]] = []

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            weights = {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()}
            seen.append((float(trainer.callback_metrics["train/signal_free"]), weights))

    trainer = quiet_trainer(max_steps=3, callbacks=[Snapshot()])
    trainer.fit(module, train_dataloaders=DataLoader([signal, *flat], batch_size=None))
    assert [free for free, _ in seen] == [0.0, 1.0, 1.0]
    after_signal, after_flat = seen[0][1], seen[2][1]
    unchanged = all(torch.equal(after_signal[n], after_flat[n]) for n in after_signal)
    assert unchanged is skip


def test_skipping_signal_free_updates_is_refused_under_fp16s_grad_scaler():
    """fp16's `GradScaler` asserts on an optimizer step that saw no gradient: refused in one
    line before anything runs; bf16 and fp32 take it."""
    from composer_lightning.runtime.errors import ConfigError
    from composer_lightning.runtime.inputs import check_trainer_options
    from tests.helpers import fit_trainer_stub

    def trainer(precision):
        return fit_trainer_stub(precision=precision)

    with pytest.raises(ConfigError, match=r"skip_signal_free_updates .*precision=16-mixed"):
        check_trainer_options(trainer("16-mixed"), skip_signal_free=True)
    check_trainer_options(trainer("16-mixed"), skip_signal_free=False)
    for precision in ("bf16-mixed", "32-true"):
        check_trainer_options(trainer(precision), skip_signal_free=True)

"""`teacher_cap`: a head that reads a hinted teacher pulls on the policy at most `teacher_cap`
times as hard as the other heads together, and not at all where they have no gradient."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.functional.gradients import hidden_gradients
from composer_lightning.heads.context_distill import ContextDistillHead
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.protocols.batch import RolloutBatch, pad_rows
from composer_lightning.protocols.step import StepContext
from composer_lightning.training.mixer import teacher_cap_scales
from composer_lightning.training.module import ComposerModule
from composer_lightning.training.objective import Objective
from tests.helpers import Fixed, quiet_trainer, tiny_model


class FixedTeacher(Fixed):
    """The same, declared as reading a hinted teacher."""

    requires = frozenset({"teacher_logprobs"})


def test_the_scales_by_hand():
    """Pieces rl, kl (the rest) and opd, sdpo (teachers) with the Gram matrix below: the
    rest's norm is sqrt(4 + 1 + 2·1) = sqrt(7); opd's norm 4 > 0.5·sqrt(7) is scaled to it,
    sdpo's 1 ≤ 0.5·sqrt(7) = 1.32 keeps 1; the rest keeps 1."""
    names = ["rl", "opd", "kl", "sdpo"]
    gram = torch.tensor(
        [[4.0, 0.0, 1.0, 0.0], [0.0, 16.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    scales = teacher_cap_scales(gram, names, {"opd", "sdpo"}, 0.5)
    assert scales["rl"] == scales["kl"] == scales["sdpo"] == 1.0
    assert scales["opd"] == pytest.approx(0.5 * math.sqrt(7) / 4, abs=1e-15)
    no_rest = torch.zeros(4, 4, dtype=torch.float64)
    no_rest[1, 1] = 16.0
    assert teacher_cap_scales(no_rest, names, {"opd", "sdpo"}, 0.5)["opd"] == 0.0
    alone = teacher_cap_scales(no_rest, names, {"opd", "sdpo"}, 0.5, alone=0.3)
    assert alone == {"rl": 1.0, "opd": 0.3, "kl": 1.0, "sdpo": 1.0}  # sdpo: no gradient
    # with a rest gradient, `alone` changes nothing
    assert teacher_cap_scales(gram, names, {"opd", "sdpo"}, 0.5, alone=0.3) == scales


def _case(rl_scale: float, teacher_scale: float):
    """Linear log-probs in leaf states h with ratio 1 (no clip binds): the mixed surrogate's
    gradient is the sum of the pieces' (`tests/test_grad_share.py`)."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    batch = synthetic_batch(g, prompts=1, group_size=B, prompt_length=2, response_length=T - 2)
    batch.response_mask = torch.rand(B, T, generator=g) < 0.8
    h = torch.randn(B, T, 4, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(4, generator=g, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ctx = StepContext(0, old + (h - h.detach()) @ v, old, "token_mean", T, 1.0, states=h)
    a1 = torch.randn(B, T, generator=g, dtype=torch.float64) * rl_scale
    a2 = torch.randn(B, T, generator=g, dtype=torch.float64) * teacher_scale
    return batch, ctx, [Fixed("rl", a1), FixedTeacher("opd", a2)]


@pytest.mark.parametrize("alone", [0.0, 0.25])
@pytest.mark.parametrize("rl_scale,teacher_scale", [(1.0, 5.0), (1.0, 0.1), (0.0, 5.0)])
def test_a_teacher_pulls_at_most_cap_times_the_rest(rl_scale, teacher_scale, alone):
    batch, ctx, heads = _case(rl_scale, teacher_scale)
    weights = {"rl": 1.0, "opd": 1.0}
    plain = Objective(heads, aggregation="token_mean", teacher_cap=None)
    pieces = hidden_gradients(
        plain.pieces(batch, ctx, plain.head_outputs(batch, ctx, weights), weights), [ctx.states]
    )
    g_rl, g_t = pieces["rl"][0], pieces["opd"][0]
    want = min(1.0, 0.5 * float(g_rl.norm()) / float(g_t.norm())) if rl_scale else alone
    capped = Objective(heads, aggregation="token_mean", teacher_cap=0.5, teacher_alone=alone)
    loss, metrics = capped(batch, ctx, weights)
    (whole,) = torch.autograd.grad(loss, ctx.states)
    assert float(metrics["opd/weight"]) == pytest.approx(want, abs=1e-12)
    assert float(metrics["opd/cap_scale"]) == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(whole, g_rl + want * g_t, rtol=0, atol=1e-12)
    if rl_scale == 0.0 and alone == 0.0:  # no rest gradient: the teacher does not lead alone
        assert float(whole.abs().max()) == 0.0
    if rl_scale == 0.0 and alone:  # ... unless told to, at `alone` times its weight
        torch.testing.assert_close(whole, alone * g_t, rtol=0, atol=1e-12)
        assert float(g_t.abs().max()) > 0
    loss, metrics = plain(batch, ctx, weights)
    assert "opd/cap_scale" not in metrics and float(metrics["opd/weight"]) == 1.0


def test_a_teacher_alone_or_a_matching_option_is_not_capped():
    batch, ctx, heads = _case(1.0, 5.0)
    alone = Objective(heads[1:], aggregation="token_mean")
    assert not alone.caps_teachers({"opd": 1.0})
    matched = Objective(heads, aggregation="token_mean", grad_norm_matching="rl")
    assert not matched.caps_teachers({"rl": 1.0, "opd": 1.0})
    capped = Objective(heads, aggregation="token_mean")
    assert capped.teacher_cap == 0.2 and capped.caps_teachers({"rl": 1.0, "opd": 1.0})
    assert not capped.caps_teachers({"rl": 0.0, "opd": 1.0})  # the rest ramped out
    with pytest.raises(ValueError, match="teacher_cap must be a finite number >= 0 or None"):
        Objective(heads, teacher_cap=-1.0)
    for bad in (-0.1, 1.5, float("nan"), True, "0.2"):
        with pytest.raises(ValueError, match=r"teacher_alone must be a number in \[0, 1\], got"):
            Objective(heads, teacher_alone=bad)


@pytest.mark.parametrize("micro", [None, 5])
def test_where_no_group_has_signal_an_opd_step_leaves_the_policy_as_it_was(micro):
    """Every group's rewards tie (no RL gradient): OPD with a live teacher on every sample
    pulls 0 under the cap with `teacher_alone: 0`, so an SGD step changes no weight — with
    and without micro-batches (the step keeps the hidden states it measures at). At the
    default `teacher_alone` (0.2) the teacher moves the policy, at a fifth of its weight."""
    batch = synthetic_batch(
        torch.Generator().manual_seed(1),
        prompts=2,
        group_size=2,
        vocab_size=64,
        reward_prob=1.0,
        hint_prob=1.0,
    )
    batch.rewards = torch.ones_like(batch.rewards)

    def sgd_step(**options) -> tuple[ComposerModule, dict]:
        """One SGD step (lr 1, no clipping) of Dr. GRPO + OPD on the tiny model: the module
        and the step's logged metrics."""
        module = ComposerModule(
            tiny_model(),
            [DrGRPOHead(), OPDHead()],
            optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
            max_grad_norm=None,
            **options,
        )
        trainer = quiet_trainer(max_steps=1)
        trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
        return module, trainer.callback_metrics

    before = {k: v.clone() for k, v in tiny_model().state_dict().items()}
    module, metrics = sgd_step(micro_batch_size=micro, teacher_alone=0.0)
    assert float(metrics["opd/cap_scale"]) == 0.0
    for k, v in module.policy.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    uncapped, _ = sgd_step(teacher_cap=None)
    moved = any(not torch.equal(v, before[k]) for k, v in uncapped.policy.state_dict().items())
    assert moved  # the same step uncapped: OPD alone moves the policy
    alone, metrics = sgd_step(micro_batch_size=micro)
    assert alone.objective.teacher_alone == 0.2  # the default
    assert float(metrics["opd/cap_scale"]) == pytest.approx(0.2)
    # SGD: the step is linear in the weight, so it is a fifth of the uncapped one
    for k, v in alone.policy.state_dict().items():
        torch.testing.assert_close(
            v - before[k], 0.2 * (uncapped.policy.state_dict()[k] - before[k]), rtol=1e-5, atol=1e-7
        )


def _distill_step(tie: bool, **options) -> tuple[ComposerModule, dict, dict]:
    """One SGD step (lr 1, no clipping) of Dr. GRPO + context distillation on the tiny model,
    two hinted replies per group to imitate: the module, the step's logged metrics and the
    weights before. `tie`: every group's rewards equal (no RL gradient)."""
    g = torch.Generator().manual_seed(3)
    batch = synthetic_batch(g, prompts=2, group_size=2, vocab_size=64, reward_prob=1.0)
    if tie:
        batch.rewards = torch.ones_like(batch.rewards)
    replies = [(0, [5, 6, 7], [11, 12, 13, 2]), (1, [8, 9], [15, 16, 17, 18, 2])]
    seqs = [p + r for _, p, r in replies]
    batch.hinted = RolloutBatch(
        input_ids=pad_rows(seqs),
        attention_mask=pad_rows([[1] * len(s) for s in seqs]),
        response_mask=pad_rows(
            [[False] * len(p) + [True] * len(r) for _, p, r in replies], dtype=torch.bool
        ),
        rewards=torch.ones(2),
        has_reward=torch.ones(2, dtype=torch.bool),
        group_ids=torch.tensor([g for g, *_ in replies]),
        max_response_length=8,
    )
    module = ComposerModule(
        tiny_model(),
        [DrGRPOHead(), ContextDistillHead(weight=5.0)],
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        max_grad_norm=None,
        **options,
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    return module, trainer.callback_metrics, before


@pytest.mark.parametrize("micro", [None, 3])
def test_context_distillation_is_capped_at_its_own_replies_states(micro):
    """Context distillation's NLL is on the hinted replies, other sequences than the batch's:
    the cap measures its gradient at those replies' final hidden states, so it pulls at most
    `teacher_cap` times the RL heads (`min(1, cap · ‖g_rl‖ / ‖g_cd‖)` from the norms the
    uncapped step logs), and at `teacher_alone` times its weight where RL has no gradient."""
    _, free, _ = _distill_step(False, teacher_cap=None, grad_share_every_n_steps=1)
    n_rl, n_cd = float(free["dr_grpo/grad_norm"]), float(free["context_distill/grad_norm"])
    assert n_rl > 0 and n_cd > 5 * n_rl  # the imitation pulls harder than a fifth of RL
    _, capped, _ = _distill_step(False, micro_batch_size=micro)
    assert float(capped["context_distill/cap_scale"]) == pytest.approx(0.2 * n_rl / n_cd, rel=1e-4)
    assert float(capped["context_distill/weight"]) == pytest.approx(
        5.0 * 0.2 * n_rl / n_cd, rel=1e-4
    )
    # no RL gradient: the imitation moves the policy at a fifth of its weight (SGD is linear)
    uncapped, _, before = _distill_step(True, teacher_cap=None)
    alone, metrics, _ = _distill_step(True, micro_batch_size=micro)
    assert float(metrics["context_distill/cap_scale"]) == pytest.approx(0.2)
    for k, v in alone.policy.state_dict().items():
        torch.testing.assert_close(
            v - before[k], 0.2 * (uncapped.policy.state_dict()[k] - before[k]), rtol=1e-5, atol=1e-7
        )

"""Built-in heads through the module's shared forward, against direct references."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.functional import generalized_jsd, kl_penalty, logprobs_from_logits
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.training.module import ComposerModule
from tests.helpers import context, full_logits, one_sample_batch, tiny_model


def _batch(**kw):
    return synthetic_batch(torch.Generator().manual_seed(4), vocab_size=64, **kw)


def test_sdpo_equals_the_jsd_of_student_and_hinted_teacher_on_masked_tokens():
    policy, teacher = tiny_model(seed=0), tiny_model(seed=1)
    batch = _batch(hint_prob=1.0)
    head = SDPOHead(beta=0.3, temperature=0.7, clip=None)
    module = ComposerModule(policy, [head], teacher=teacher)
    ctx = context(module, batch, set(head.requires))
    loss = head.compute(batch, ctx).loss
    # reference: explicit per-sample loops over the mapped positions
    s_logits = full_logits(policy, batch.input_ids, batch.attention_mask)
    t_logits = full_logits(teacher, batch.teacher_input_ids, batch.teacher_attention_mask)
    rows_s, rows_t = [], []
    for b in range(batch.batch_size):
        for t in range(batch.input_ids.shape[1]):
            if batch.sdpo_mask[b, t]:
                p = int(batch.teacher_positions[b, t])
                rows_s.append(s_logits[b, t - 1])
                rows_t.append(t_logits[b, p - 1])
    ref = generalized_jsd(torch.stack(rows_s), torch.stack(rows_t), beta=0.3, temperature=0.7)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)


def test_sdpo_without_a_hint_in_context_is_zero():
    """Teacher = the live policy on the very same context: JSD(p, p) = 0."""
    batch = one_sample_batch(
        [5, 9], [20, 21, 22], [], reward=1.0, has_reward=True, has_teacher=True
    )
    head = SDPOHead()
    module = ComposerModule(tiny_model(), [head])
    out = head.compute(batch, context(module, batch, set(head.requires)))
    assert abs(float(out.loss)) < 1e-12 and out.metrics["tokens"] == 3


def test_misaligned_teacher_positions_skip_sdpo_and_opd_with_a_warning():
    batch = one_sample_batch(
        [5, 9], [20, 21, 22], [40], reward=1.0, has_reward=True, has_teacher=True
    )
    batch.teacher_positions[batch.teacher_positions >= 0] -= 1  # off by one: wrong tokens
    module = ComposerModule(tiny_model(), [SDPOHead(), OPDHead()])
    ctx = context(module, batch, {"hidden", "teacher_hidden", "teacher_logprobs"})
    with pytest.warns(UserWarning, match="SDPO term is skipped"):
        sdpo = module.heads[0].compute(batch, ctx)
    assert float(sdpo.loss) == 0.0 and sdpo.metrics["misaligned"] == 1.0
    with pytest.warns(UserWarning, match="misaligned"):
        opd = module.heads[1].compute(batch, ctx)
    assert torch.all(opd.advantages == 0)


def test_a_teacher_position_past_the_row_skips_only_that_sample():
    """Sample 1's teacher positions point past the end of its teacher row: no index error, its
    SDPO term is left out with a warning, sample 0's term is the plain JSD of its tokens."""
    policy, teacher = tiny_model(seed=0), tiny_model(seed=1)
    batch = _batch(hint_prob=1.0, prompts=1, group_size=2)
    assert batch.batch_size == 2
    batch.teacher_positions[1][batch.teacher_positions[1] >= 0] += 1000
    head = SDPOHead(beta=0.5, clip=None)
    module = ComposerModule(policy, [head], teacher=teacher)
    ctx = context(module, batch, set(head.requires))
    with pytest.warns(UserWarning, match="in 1 sample"):
        out = head.compute(batch, ctx)
    s_logits = full_logits(policy, batch.input_ids, batch.attention_mask)
    t_logits = full_logits(teacher, batch.teacher_input_ids, batch.teacher_attention_mask)
    rows = [
        (t, int(batch.teacher_positions[0, t]))
        for t in range(batch.input_ids.shape[1])
        if batch.sdpo_mask[0, t]
    ]
    ref = generalized_jsd(
        torch.stack([s_logits[0, t - 1] for t, _ in rows]),
        torch.stack([t_logits[0, p - 1] for _, p in rows]),
    )
    torch.testing.assert_close(out.loss, ref, rtol=0, atol=1e-12)
    assert out.metrics["tokens"] == len(rows) and out.metrics["misaligned"] == 1.0


def test_kl_to_a_fresh_reference_copy_is_zero_and_matches_kl_penalty():
    batch = _batch()
    for placement, est in (("advantage", "k1"), ("loss", "k3"), ("loss", "k2")):
        policy = tiny_model()
        head = KLHead(kl_coef=0.1, estimator=est, placement=placement)
        module = ComposerModule(policy, [head])  # reference = a frozen copy
        ctx = context(module, batch, set(head.requires))
        out = head.compute(batch, ctx)
        value = out.advantages if out.advantages is not None else out.loss
        assert torch.all(value == 0)
        with torch.no_grad():  # perturb the policy: now the KL must match the estimator
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ctx = context(module, batch, set(head.requires))
        out = head.compute(batch, ctx)
        ref_lp = logprobs_from_logits(
            full_logits(module.reference, batch.input_ids, batch.attention_mask), batch.input_ids
        )
        k = kl_penalty(ctx.logprobs.detach(), ref_lp, est) * batch.response_mask
        if placement == "advantage":
            torch.testing.assert_close(out.advantages, -k, rtol=0, atol=1e-12)
        else:
            expected = k.sum() / (batch.batch_size * batch.max_response_length)  # token_sum_norm
            torch.testing.assert_close(out.loss.detach(), expected, rtol=0, atol=1e-12)


def test_replay_dpo_records_pairs_and_starts_at_log2():
    """At record time the policy equals the stored reference, so z = 0 and L = log 2."""
    batch = _batch(reward_prob=1.0, group_size=4)
    head = ReplayDPOHead(pairs_per_step=2, capacity=3)
    module = ComposerModule(tiny_model(), [head])
    ctx = context(module, batch, set(head.requires))
    head.on_rollout(batch, ctx.old_logprobs)
    groups_with_pairs = sum(
        int(len(set(batch.rewards[batch.group_ids == g].tolist())) > 1)
        for g in batch.group_ids.unique()
    )
    assert len(head.buffer) == min(groups_with_pairs, 3) > 0
    out = head.compute(batch, ctx)
    assert float(out.loss) == pytest.approx(math.log(2), abs=1e-12)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.policy.parameters())
    # capacity evicts the oldest pairs
    for _ in range(3):
        head.on_rollout(batch, ctx.old_logprobs)
    assert len(head.buffer) == 3


def test_replay_dpo_with_reference_model():
    batch = _batch(reward_prob=1.0)
    head = ReplayDPOHead(reference="model")
    policy = tiny_model()
    module = ComposerModule(policy, [head], reference=copy.deepcopy(policy))
    ctx = context(module, batch, set(head.requires))
    head.on_rollout(batch, ctx.old_logprobs)
    assert float(head.compute(batch, ctx).loss) == pytest.approx(math.log(2), abs=1e-12)


def test_replay_dpo_prefers_the_higher_reward_sample():
    """One group, rewards [1, 0]: the pair is (chosen = sample 0, rejected = sample 1) with the
    record-time log-probs as reference. After the policy moves, the loss is
    −log σ(β((lp_c − ref_c) − (lp_r − ref_r))) from direct forwards; swapping chosen and
    rejected anywhere would flip the sign of z."""
    batch = _batch(prompts=1, group_size=2, reward_prob=1.0)
    batch.rewards = torch.tensor([1.0, 0.0])
    batch.has_reward[:] = True
    policy = tiny_model()
    head = ReplayDPOHead(beta=0.5, pairs_per_step=1)
    module = ComposerModule(policy, [head])

    def seq_lp(model):
        lp = logprobs_from_logits(
            full_logits(model, batch.input_ids, batch.attention_mask), batch.input_ids
        )
        return (lp * batch.response_mask).sum(1)

    with torch.no_grad():
        ref = seq_lp(policy)
    head.on_rollout(batch, context(module, batch).old_logprobs)
    (pair,) = head.buffer
    keep = batch.attention_mask[0].bool()
    assert torch.equal(pair["chosen"], batch.input_ids[0][keep])
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        now = seq_lp(policy)
    z = float((now[0] - ref[0]) - (now[1] - ref[1]))
    assert abs(z) > 1e-3
    out = head.compute(batch, context(module, batch, set(head.requires)))
    assert float(out.loss) == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * z))), abs=1e-10)
    assert float(out.metrics["reward_margin"]) == pytest.approx(0.5 * z, abs=1e-10)

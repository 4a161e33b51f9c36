"""`ContextDistillHead`: the NLL of the hinted replies under the student's context, against a
float64 reference from the policy's plain logits; which replies it imitates (reward, minibatch
groups); its gradient; and its refusals."""

from __future__ import annotations

import pytest
import torch

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.context_distill import ContextDistillHead
from composer_lightning.heads.sft import SFTHead
from composer_lightning.protocols.batch import RolloutBatch, pad_rows
from composer_lightning.training.module import ComposerModule
from tests.helpers import context, full_logits, tiny_model

TEMPERATURE = 0.7
# (group, student prompt, hinted reply, reward or None)
REPLIES = [
    (0, [5, 6, 7], [11, 12, 13, 2], 1.0),
    (0, [5, 6, 7], [14, 2], 0.0),
    (1, [8, 9], [15, 16, 17, 18, 2], 1.0),
    (2, [3, 4, 5, 6], [19, 2], None),
]


def _hinted() -> RolloutBatch:
    seqs = [p + r for _, p, r, _ in REPLIES]
    return RolloutBatch(
        input_ids=pad_rows(seqs),
        attention_mask=pad_rows([[1] * len(s) for s in seqs]),
        response_mask=pad_rows(
            [[False] * len(p) + [True] * len(r) for _, p, r, _ in REPLIES], dtype=torch.bool
        ),
        rewards=torch.tensor([0.0 if v is None else v for *_, v in REPLIES]),
        has_reward=torch.tensor([v is not None for *_, v in REPLIES]),
        group_ids=torch.tensor([g for g, *_ in REPLIES]),
        max_response_length=8,
    )


def _batch(groups: int = 3) -> RolloutBatch:
    batch = synthetic_batch(
        torch.Generator().manual_seed(0), prompts=groups, group_size=2, vocab_size=64
    )
    batch.hinted = _hinted()
    return batch


def _module(head: ContextDistillHead, aggregation: str = "token_mean") -> ComposerModule:
    module = ComposerModule(
        tiny_model(), [head], aggregation=aggregation, temperature=TEMPERATURE, norm_length=8
    )
    return module


def _reference(model, rows: list[int]) -> list[list[float]]:
    """Each listed reply's token log-probs under the student's context, in float64 from the
    policy's plain logits at the sampling temperature."""
    out = []
    for k in rows:
        _, prompt, reply, _ = REPLIES[k]
        ids = torch.tensor([prompt + reply])
        with torch.no_grad():
            logits = full_logits(model, ids, torch.ones_like(ids)).double() / TEMPERATURE
        lp = torch.log_softmax(logits[0, :-1], dim=-1)
        out.append([float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(reply)])
    return out


def test_the_loss_is_the_token_mean_nll_of_the_accepted_replies():
    head = ContextDistillHead()  # min_reward 1.0: replies 0 and 2
    module = _module(head)
    batch = _batch()
    out = head.compute(batch, context(module, batch))
    ref = _reference(module.policy, [0, 2])
    tokens = [v for row in ref for v in row]
    assert abs(float(out.loss.detach()) - (-sum(tokens) / len(tokens))) < 1e-10
    assert float(out.metrics["imitated"]) == 2 and float(out.metrics["tokens"]) == len(tokens)


def test_min_reward_none_imitates_every_reply_and_the_aggregation_is_the_modules():
    head = ContextDistillHead(min_reward=None)
    module = _module(head, "seq_mean_token_mean")
    batch = _batch()
    out = head.compute(batch, context(module, batch))
    ref = _reference(module.policy, [0, 1, 2, 3])
    expected = sum(-sum(row) / len(row) for row in ref) / len(ref)
    assert abs(float(out.loss.detach()) - expected) < 1e-10
    low = ContextDistillHead(min_reward=0.0)  # scored rows only: 0, 1, 2
    out = low.compute(batch, context(_module(low), batch))
    assert float(out.metrics["imitated"]) == 3


def test_it_equals_sft_on_a_batch_of_the_hinted_replies():
    """The invariant: imitating the hinted replies is SFT on them, set after the student's
    context, under every aggregation: the rows are every hinted reply of the minibatch's
    groups, and those not imitated (a wrong one, an unscored one) are rows SFT does not accept
    either, which count as rows without a token."""
    for aggregation in (
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "token_sum_norm",
    ):
        head = ContextDistillHead()
        module = _module(head, aggregation)
        batch = _batch()
        out = head.compute(batch, context(module, batch))
        rows = batch.hinted
        sft_batch = RolloutBatch(
            input_ids=rows.input_ids,
            attention_mask=rows.attention_mask,
            response_mask=rows.response_mask,
            rewards=rows.rewards,
            has_reward=rows.has_reward,
            group_ids=rows.group_ids,
            max_response_length=8,
        )
        sft = SFTHead().compute(sft_batch, context(module, sft_batch))
        torch.testing.assert_close(out.loss, sft.loss, rtol=0, atol=1e-12, msg=aggregation)


@pytest.mark.parametrize("accepted", [1, 4, 8])
def test_one_accepted_reply_of_eight_weighs_an_eighth_of_eight(accepted):
    """8 hinted replies of one group, the same tokens, `accepted` of them right; with
    `token_sum_norm` the loss is accepted / 8 of the loss with all 8 accepted (issue 50: it
    was the whole loss whatever the count, where SFT on the same rows gives 1/8, 4/8, 8/8)."""
    prompt, reply = [5, 6, 7], [11, 12, 13, 2]
    seqs = [prompt + reply] * 8
    hinted = RolloutBatch(
        input_ids=torch.tensor(seqs),
        attention_mask=torch.ones(8, 7, dtype=torch.long),
        response_mask=torch.tensor([[False] * 3 + [True] * 4] * 8),
        rewards=torch.tensor([1.0] * accepted + [0.0] * (8 - accepted)),
        has_reward=torch.ones(8, dtype=torch.bool),
        group_ids=torch.zeros(8, dtype=torch.long),
        max_response_length=8,
    )
    batch = _batch(groups=1)
    batch.hinted = hinted
    head = ContextDistillHead()
    module = _module(head, "token_sum_norm")
    out = head.compute(batch, context(module, batch))
    (ref,) = _reference(module.policy, [0])  # REPLIES[0] is the same prompt and reply
    whole = -sum(ref) / 8  # one reply's token sum / (1 row × norm_length 8)
    assert abs(float(out.loss.detach()) - whole * accepted / 8) < 1e-10


def test_a_minibatch_imitates_the_replies_of_its_own_groups():
    head = ContextDistillHead(min_reward=None)
    module = _module(head)
    batch = _batch()
    first = batch.select(torch.nonzero(batch.group_ids == batch.group_ids[0]).flatten())
    out = head.compute(first, context(module, first))
    assert float(out.metrics["imitated"]) == 2  # group 0's two replies
    ref = [v for row in _reference(module.policy, [0, 1]) for v in row]
    assert abs(float(out.loss.detach()) - (-sum(ref) / len(ref))) < 1e-10


def test_the_gradient_reaches_the_policy_and_none_without_replies():
    head = ContextDistillHead()
    module = _module(head)
    batch = _batch()
    out = head.compute(batch, context(module, batch))
    out.loss.backward()
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    module.policy.zero_grad(set_to_none=True)
    nobody = ContextDistillHead(min_reward=2.0)
    out = nobody.compute(batch, context(_module(nobody), batch))
    assert float(out.loss.detach()) == 0.0 and float(out.metrics["imitated"]) == 0
    out.loss.backward()  # the placeholder forward: on the graph, all-zero gradients
    assert all(
        float(p.grad.abs().sum()) == 0 for p in module.policy.parameters() if p.grad is not None
    )


def test_refusals():
    with pytest.raises(ValueError, match="min_reward must be a finite number or None"):
        ContextDistillHead(min_reward=float("inf"))
    head = ContextDistillHead()
    module = _module(head)
    batch = _batch()
    batch.hinted = None
    with pytest.raises(ValueError, match="set rollout.hinted_replies"):
        head.compute(batch, context(module, batch))
    with pytest.raises(ValueError, match="RolloutBatch.group_ids has shape"):
        RolloutBatch(
            input_ids=torch.zeros(2, 3, dtype=torch.long),
            attention_mask=torch.ones(2, 3),
            response_mask=torch.ones(2, 3),
            rewards=torch.zeros(2),
            has_reward=torch.ones(2),
            group_ids=torch.zeros(3),
            max_response_length=3,
        )

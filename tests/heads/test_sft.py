"""`SFTHead`: the NLL of accepted rows' response tokens, against a float64 hand reference, and
demonstrations of the tool task that train a policy to make the call they show."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from composer_lightning.functional.policy import masked_aggregate
from composer_lightning.heads.sft import SFTHead
from composer_lightning.protocols.batch import RolloutBatch


def _batch_and_ctx(mode: str = "token_mean"):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    response_mask[0, 2:5] = True
    response_mask[1, 1:6] = True
    response_mask[2, 3:4] = True
    response_mask[3, 2:6] = True
    batch = RolloutBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        response_mask=response_mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
        has_reward=torch.tensor([True, True, True, False]),  # row 3: no reward, never imitated
        group_ids=torch.arange(B),
        max_response_length=T,
    )
    logprobs = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ctx = SimpleNamespace(
        logprobs=logprobs, aggregate=lambda v, m: masked_aggregate(v, m, mode, norm_length=8.0)
    )
    return batch, ctx, logprobs


def test_sft_is_the_mean_nll_of_the_accepted_rows_response_tokens():
    batch, ctx, lp = _batch_and_ctx()
    out = SFTHead().compute(batch, ctx)
    # by hand: rows 0 (tokens 2..4) and 2 (token 3) have reward 1; row 1 has 0, row 3 none
    tokens = [(0, 2), (0, 3), (0, 4), (2, 3)]
    ref = -sum(float(lp.detach()[b, t]) for b, t in tokens) / len(tokens)
    assert abs(float(out.loss) - ref) < 1e-12
    (grad,) = torch.autograd.grad(out.loss, lp)
    expected = torch.zeros_like(grad)
    for b, t in tokens:
        expected[b, t] = -1 / len(tokens)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    assert float(out.metrics["accepted_frac"]) == 0.5 and float(out.metrics["tokens"]) == 4
    assert abs(float(out.metrics["nll"]) - ref) < 1e-12


def test_sft_min_reward_and_the_modules_aggregation():
    batch, ctx, lp = _batch_and_ctx("seq_mean_token_mean")
    out = SFTHead(min_reward=0.0).compute(batch, ctx)  # rows 0, 1, 2 (row 3 has no reward)
    rows = {0: (2, 5), 1: (1, 6), 2: (3, 4)}
    # the mean over all 4 rows: row 3, not imitated, counts as a row without a token (TRL's
    # `grpo` reduction, `functional.masked_aggregate`)
    ref = sum(-float(lp.detach()[b, s:e].mean()) for b, (s, e) in rows.items()) / 4
    assert abs(float(out.loss) - ref) < 1e-12
    nobody = SFTHead(min_reward=2.0).compute(batch, ctx)
    assert float(nobody.loss) == 0.0 and nobody.loss.requires_grad  # still on the graph


def test_sft_refuses_a_bad_min_reward():
    with pytest.raises(ValueError, match="min_reward must be a finite number, got nan"):
        SFTHead(min_reward=float("nan"))
    with pytest.raises(ValueError, match="min_reward must be a finite number, got True"):
        SFTHead(min_reward=True)


def test_tool_demonstrations_are_right_episodes_outside_the_held_out_split():
    from composer_lightning.rollout.validation import is_heldout
    from composer_lightning.tasks.tool_calc import ToolCalc
    from examples.tool_sft.make_demos import demos

    task = ToolCalc()
    records = demos(64, seed=3)
    assert len(records) == 64
    for rec in records:
        problem = {"messages": rec["messages"][:1]}
        assert not is_heldout(problem, 0.2)
        assert rec["reward"] == 1.0 and rec["tools"][0]["function"]["name"] == "add"
        user, call, result, answer = rec["messages"]
        assert call["content"].startswith("<tool_call>") and result["role"] == "tool"
        a, b = (int(x) for x in call["content"].split('"a": ')[1].split("}")[0].split(', "b": '))
        assert result["content"] == str(a + b) and answer["content"] == f"The answer is {a + b}."
    problem = task.sample(random.Random(5))
    rec = task.demonstration(problem)
    assert task.verify(problem, rec["messages"][-1]["content"]).reward == 1.0

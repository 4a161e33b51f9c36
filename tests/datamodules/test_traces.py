"""Multi-turn tool traces: hints spliced after the error turn, aligned by token index."""

from __future__ import annotations

import json

import pytest
import torch

from composer_lightning.datamodules.traces import TraceDataModule
from composer_lightning.functional.align import teacher_alignment
from composer_lightning.models.tiny import tiny_policy_path
from tests.helpers import ROOT

POLICY = tiny_policy_path()
TRACES = str(ROOT / "examples" / "traces" / "tool_traces.jsonl")


def test_trace_batches_follow_the_contract_and_the_dispatch():
    dm = TraceDataModule(tokenizer=POLICY, trace_file=TRACES, batch_size=9)
    assert dm.dropped == 3 and len(dm.samples) == 6  # traces with neither a hint nor a reward
    batch = dm.batch(0)
    assert batch.batch_size == 9
    # every mapped student token sits at a teacher position holding the same token
    assert teacher_alignment(
        batch.input_ids, batch.teacher_input_ids, batch.teacher_positions, batch.sdpo_mask
    ).all()
    assert torch.all(batch.sdpo_mask <= batch.response_mask)
    assert torch.all(batch.has_teacher == batch.sdpo_mask.any(1))
    tok = dm.tokenizer
    for b in range(batch.batch_size):
        if not batch.has_teacher[b]:
            continue
        t_text = tok.decode(batch.teacher_input_ids[b][batch.teacher_attention_mask[b].bool()])
        s_text = tok.decode(batch.input_ids[b][batch.attention_mask[b].bool()])
        assert "add(a, b)" in t_text and "add(a, b)" not in s_text
        # the hint comes after the tool error and before the recovery turn
        assert t_text.index("unknown function") < t_text.index("add(a, b)") < t_text.rindex("add(")
        # the recovery (SDPO) tokens are the assistant turns after the error only
        recovery = tok.decode(batch.input_ids[b][batch.sdpo_mask[b]])
        assert "calc(" not in recovery and "add(" in recovery


def test_trace_file_errors(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n{oops\n")
    with pytest.raises(ValueError, match="t.jsonl:2: not valid JSON"):
        TraceDataModule(tokenizer=POLICY, trace_file=str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "reward": 3}) + "\n")
    with pytest.raises(ValueError, match="t.jsonl:1: reward must be a number in \\[0, 1\\], got 3"):
        TraceDataModule(tokenizer=POLICY, trace_file=str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": "add"}))
    with pytest.raises(ValueError, match="t.jsonl:1: tools must be a list of OpenAI tool specs"):
        TraceDataModule(tokenizer=POLICY, trace_file=str(bad))
    bad.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
        )
        + "\n"
    )
    with pytest.raises(ValueError, match="no trace .* has a usable hint or reward"):
        TraceDataModule(tokenizer=POLICY, trace_file=str(bad))

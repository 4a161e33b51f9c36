"""`TraceDataModule`: rollout batches from recorded multi-turn tool traces (no engine).

Each JSONL line is a chat whose turns may carry a structured `tool_error` field, plus an
optional `hint` (spliced right after the first erroneous turn, before the next assistant turn)
and an optional `reward` in [0, 1]:

    {"messages": [{"role": "user", ...}, {"role": "assistant", ...},
                  {"role": "tool", "content": "...", "tool_error": "KeyError"}, ...],
     "hint": "the key is called 'total'", "reward": 0.0}

Assistant tokens carry loss; `sdpo_mask` covers the assistant tokens after the hint (the
recovery). The dispatch is the usual one: a hint makes `has_teacher`, a reward `has_reward`, a
trace with neither is dropped (and counted). Traces are recorded, not sampled by the current
policy, so they train SDPO / OPD / reward heads off-policy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from composer_lightning.batch import RolloutBatch
from composer_lightning.chat import TraceSample, multi_turn_sample
from composer_lightning.datamodules.jsonl import read_jsonl


def _trace_problem(obj: dict[str, Any]) -> str | None:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
        return "needs 'messages', a list of {role, content}"
    reward = obj.get("reward")
    if reward is not None and not (isinstance(reward, (int, float)) and 0 <= reward <= 1):
        return f"reward must be a number in [0, 1], got {reward!r}"
    return None


def read_traces(path: str) -> list[dict[str, Any]]:
    """Trace records from a JSONL file; a malformed line is an error naming file and line."""
    return read_jsonl(path, "trace", _trace_problem)


def pack_traces(samples: list[TraceSample], rewards: list[float | None], ids: list[int],
                pad_id: int, max_response_length: int) -> RolloutBatch:
    """Right-padded `RolloutBatch` of tokenised traces."""
    B = len(samples)
    T = max(len(s.student_ids) for s in samples)
    Tt = max([len(s.teacher_ids) for s in samples if s.teacher_ids is not None], default=1)
    batch = {
        "input_ids": torch.full((B, T), pad_id), "attention_mask": torch.zeros(B, T, dtype=torch.long),
        "response_mask": torch.zeros(B, T, dtype=torch.bool), "sdpo_mask": torch.zeros(B, T, dtype=torch.bool),
        "teacher_positions": torch.full((B, T), -1), "teacher_input_ids": torch.full((B, Tt), pad_id),
        "teacher_attention_mask": torch.zeros(B, Tt, dtype=torch.long),
    }
    for b, s in enumerate(samples):
        n = len(s.student_ids)
        batch["input_ids"][b, :n] = torch.tensor(s.student_ids)
        batch["attention_mask"][b, :n] = 1
        batch["response_mask"][b, :n] = torch.tensor(s.response_mask)
        batch["sdpo_mask"][b, :n] = torch.tensor(s.sdpo_mask)
        batch["teacher_positions"][b, :n] = torch.tensor(s.teacher_positions)
        if s.teacher_ids is not None:
            batch["teacher_input_ids"][b, : len(s.teacher_ids)] = torch.tensor(s.teacher_ids)
            batch["teacher_attention_mask"][b, : len(s.teacher_ids)] = 1
        else:
            batch["teacher_attention_mask"][b, 0] = 1
    return RolloutBatch(
        **batch, rewards=torch.tensor([r or 0.0 for r in rewards], dtype=torch.float),
        has_reward=torch.tensor([r is not None for r in rewards]), group_ids=torch.tensor(ids),
        has_teacher=torch.tensor([s.has_teacher for s in samples]),
        max_response_length=max_response_length,
    )


class _TraceStream(IterableDataset):
    def __init__(self, dm: TraceDataModule):
        self.dm = dm

    def __iter__(self) -> Iterator[RolloutBatch]:
        i = self.dm.consumed
        while True:
            yield self.dm.batch(i)
            i += 1


class TraceDataModule(L.LightningDataModule):
    """Rollout batches of recorded tool traces with hints at their error turns.

    Args:
        tokenizer: local tokenizer directory (with a prefix-stable chat template).
        trace_file: JSONL traces (see the module docstring).
        batch_size: traces per batch.
        hint_role: role of the hint message (`user` or `system`).
        seed: shuffling seed (each pass over the file is a fresh permutation).
    """

    def __init__(self, tokenizer: str, trace_file: str, batch_size: int = 4, hint_role: str = "user",
                 seed: int = 0):
        super().__init__()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.batch_size, self.hint_role, self.seed = batch_size, hint_role, seed
        records = read_traces(trace_file)
        self.samples, self.rewards, self.dropped = [], [], 0
        for rec in records:
            sample = multi_turn_sample(self.tokenizer, rec["messages"], rec.get("hint"), hint_role)
            if not sample.has_teacher and rec.get("reward") is None:
                self.dropped += 1  # neither signal: the fourth dispatch path
                continue
            self.samples.append(sample)
            self.rewards.append(rec.get("reward"))
        if not self.samples:
            raise ValueError(f"no trace in {trace_file!r} has a usable hint or reward "
                             f"({self.dropped} dropped)")
        self.max_response_length = max(sum(s.response_mask) for s in self.samples)
        self.consumed = 0

    def batch(self, index: int) -> RolloutBatch:
        n = len(self.samples)
        picks = []
        for k in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, pos = divmod(k, n)
            order = list(range(n))
            random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
            picks.append(order[pos])
        rollout = pack_traces([self.samples[i] for i in picks], [self.rewards[i] for i in picks],
                              ids=list(range(len(picks))), pad_id=self.tokenizer.pad_token_id or 0,
                              max_response_length=self.max_response_length)
        rollout.extras["index"] = index
        return rollout

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_TraceStream(self), batch_size=None, collate_fn=lambda b: b)

    def on_after_batch_transfer(self, batch: RolloutBatch, dataloader_idx: int) -> RolloutBatch:
        self.consumed = int(batch.extras["index"]) + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed"])

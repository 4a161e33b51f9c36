"""`TraceDataModule`: rollout batches from recorded multi-turn tool traces (no engine).

Each JSONL line is a chat whose turns may carry a structured `tool_error` field, plus an
optional `hint` (spliced right after the first erroneous turn, before the next assistant turn),
an optional `reward` in [0, 1] and optional `tools` (OpenAI tool specs, shown to the model as a
tool episode shows them):

    {"messages": [{"role": "user", ...}, {"role": "assistant", ...},
                  {"role": "tool", "content": "...", "tool_error": "KeyError"}, ...],
     "hint": "the key is called 'total'", "reward": 0.0, "tools": [{"type": "function", ...}]}

Demonstrations (a trace with `reward: 1.0`) train `SFTHead`: tool use shown to a model before
RL on the tool can start.

Assistant tokens carry loss; `sdpo_mask` covers the assistant tokens after the hint (the
recovery). The dispatch is the usual one: a hint makes `has_teacher`, a reward `has_reward`, a
trace with neither is dropped (and counted). Traces are recorded, not sampled by the current
policy, so they train SDPO / OPD / reward heads off-policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from composer_lightning.chat import multi_turn_sample
from composer_lightning.datamodules.jsonl import read_jsonl, stream_positions
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.rollout.packing import pack_samples
from composer_lightning.runtime.distributed import data_parallel


def _trace_problem(obj: dict[str, Any]) -> str | None:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
        return "needs 'messages', a list of {role, content}"
    tools = obj.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        return f"tools must be a list of OpenAI tool specs (objects), got {tools!r}"
    reward = obj.get("reward")
    if reward is not None and not (isinstance(reward, (int, float)) and 0 <= reward <= 1):
        return f"reward must be a number in [0, 1], got {reward!r}"
    return None


def read_traces(path: str) -> list[dict[str, Any]]:
    """Trace records from a JSONL file; a malformed line is an error naming file and line."""
    return read_jsonl(path, "trace", _trace_problem)


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
        tokenizer: the tokenizer (with a prefix-stable chat template): a directory, a hub id or
            a GGUF file, as a model source (`models.hub.resolve_model`).
        trace_file: JSONL traces (see the module docstring).
        batch_size: traces per batch.
        hint_role: role of the hint message (`user` or `system`).
        seed: shuffling seed (each pass over the file is a fresh permutation).
    """

    def __init__(
        self,
        tokenizer: str,
        trace_file: str,
        batch_size: int = 4,
        hint_role: str = "user",
        seed: int = 0,
    ):
        super().__init__()
        from transformers import AutoTokenizer

        from composer_lightning.models.hub import TOKENIZER_FILE, resolve_model

        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_model(tokenizer, what="TraceDataModule tokenizer", require=TOKENIZER_FILE)
        )
        self.batch_size, self.hint_role, self.seed = batch_size, hint_role, seed
        records = read_traces(trace_file)
        self.samples, self.rewards, self.dropped = [], [], 0
        for rec in records:
            sample = multi_turn_sample(
                self.tokenizer, rec["messages"], rec.get("hint"), hint_role, rec.get("tools")
            )
            if not sample.has_teacher and rec.get("reward") is None:
                self.dropped += 1  # neither signal: the fourth dispatch path
                continue
            self.samples.append(sample)
            self.rewards.append(rec.get("reward"))
        if not self.samples:
            raise ValueError(
                f"no trace in {trace_file!r} has a usable hint or reward ({self.dropped} dropped)"
            )
        self.max_response_length = max(sum(s.response_mask) for s in self.samples)
        self.consumed = 0

    def batch(self, index: int) -> RolloutBatch:
        """Rollout batch `index` of this data-parallel rank (ranks read disjoint traces)."""
        trainer = getattr(self, "trainer", None)
        rank, size = data_parallel(trainer) if trainer is not None else (0, 1)
        start = (index * size + rank) * self.batch_size
        picks = stream_positions(start, start + self.batch_size, len(self.samples), self.seed)
        rollout = pack_samples(
            [self.samples[i] for i in picks],
            rewards=[self.rewards[i] for i in picks],
            group_ids=list(range(len(picks))),
            pad_id=self.tokenizer.pad_token_id or 0,
            max_response_length=self.max_response_length,
        )
        rollout.index = index
        return rollout

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_TraceStream(self), batch_size=None, collate_fn=lambda b: b)

    def on_after_batch_transfer(self, batch: RolloutBatch, dataloader_idx: int) -> RolloutBatch:
        assert batch.index is not None  # `batch` numbers every batch it makes
        self.consumed = int(batch.index) + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed"])

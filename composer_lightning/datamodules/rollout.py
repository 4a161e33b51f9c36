"""`RolloutDataModule`: prompt batches for the rollout callback (never rollouts).

Lightning prefetches one batch ahead from an iterable dataset, so generating in `__iter__`
would sample with stale weights; the datamodule only yields tokenised prompts and the rollout
callback generates at `on_train_batch_start`. Batch i of rank r is a pure function of
(seed, i, r), so resuming at the checkpointed stream position replays nothing and skips
nothing. Prompts are sharded by rank; a prompt's G samples are generated on its rank.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset

from composer_lightning.chat import tokenize_prompt
from composer_lightning.datamodules.jsonl import stream_positions
from composer_lightning.datamodules.prompts import (
    load_prompt_dataset,
    read_prompt_file,
    truncate_left,
)
from composer_lightning.models.hub import TOKENIZER_FILE, resolve_model
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.rollout.validation import is_heldout, problem_key
from composer_lightning.runtime.distributed import data_parallel
from composer_lightning.runtime.resume import Differences
from composer_lightning.runtime.resume import line as resume_line
from composer_lightning.tasks import Task, get_task
from composer_lightning.tasks.base import Problem

__all__ = ["PromptStream", "RolloutDataModule", "read_prompt_file"]


class PromptStream(IterableDataset):
    """Endless prompt batches; batch i is `problems(i)`, starting at `start`."""

    def __init__(self, datamodule: RolloutDataModule, start: int):
        self.dm, self.start = datamodule, start

    def __iter__(self) -> Iterator[PromptBatch]:
        i = self.start
        while True:
            yield self.dm.prompt_batch(i)
            i += 1


class RolloutDataModule(L.LightningDataModule):
    """Tokenised prompt batches from a built-in task, a JSONL prompt file or a `datasets` dataset.

    Rows of a file or dataset are TRL's standard (`{"prompt": "text"}`) or conversational
    (`{"prompt": [messages]}`) format, or `{"messages": [...]}`, plus any fields the verifier or
    reward functions read (`datamodules/prompts.py`).

    Args:
        tokenizer: the tokenizer's local directory or hub id (a chat template, or none for a
            base model: plain-text prompts); None: the policy's directory
            (`ComposerModule.policy_path`).
        task: task short name (`arithmetic`, `reverse`) or dotted class path; its verifier
            scores the rollouts. With a prompt file or dataset it is the verifier of rows
            without `task`; None with `FunctionScore`.
        task_args: keyword arguments of the task's constructor.
        prompt_file: JSONL prompts (plus any fields the verifier needs); None samples the task.
        dataset: a `datasets` dataset instead: a hub id (`openai/gsm8k`), a local parquet /
            JSON / CSV file, a dataset directory (needs the `data` extra), or from Python a
            `datasets.Dataset` object (TRL's `train_dataset`).
        dataset_config: the dataset's configuration name (`main` for GSM8K), if any.
        split: the dataset split to train on (`train`, `train[:1000]`).
        columns: renames row fields, source → target (`{question: prompt}`), for either source.
        max_prompt_length: as TRL's: prompts longer than this many tokens keep their last
            `max_prompt_length` tokens (truncated from the left); None: no limit.
        prompts_per_step: prompts per rollout batch on each rank (each gets G samples).
        seed: seed of the prompt stream.
        val_fraction: share of the problem space held out for validation (by a hash of each
            problem's chat: the training stream never sees a held-out problem); 0: none.
        val_prompts: size of the validation set (fewer when the held-out space is smaller;
            for a prompt file, its held-out lines); 0: no validation.
        val_path: a held-out set of one's own (TRL's `eval_dataset`): a JSONL prompt file, a
            dataset as `dataset` takes it (a hub id's `val_split`), or a `Dataset` object. Its
            first `val_prompts` rows are the held-out set and nothing of the training data is
            held out (`val_fraction` is not used). None: split the training data.
        val_split: the split of a hub dataset or dataset directory `val_path` names.
        chat_template_kwargs: variables for the tokenizer's chat template wherever a chat is
            rendered in the run (prompts, hinted contexts, episodes; training and held-out
            alike), e.g. `{enable_thinking: false}` (TRL's `chat_template_kwargs`).

    A split of a prompt file or dataset says in one line how many rows it holds out and how
    many of those the held-out set uses.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        task: str | None = "arithmetic",
        task_args: dict | None = None,
        prompt_file: str | None = None,
        prompts_per_step: int = 8,
        seed: int = 0,
        val_fraction: float = 0.2,
        val_prompts: int = 64,
        dataset: str | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        columns: dict[str, str] | None = None,
        max_prompt_length: int | None = None,
        val_path: str | None = None,
        val_split: str = "test",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        super().__init__()
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(
                f"chat_template_kwargs must be a mapping of template variables to values, got "
                f"{chat_template_kwargs!r}"
            )
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if task is None and prompt_file is None and dataset is None:
            raise ValueError("RolloutDataModule needs a task, a prompt_file or a dataset")
        if prompt_file is not None and dataset is not None:
            raise ValueError(
                f"RolloutDataModule takes a prompt_file or a dataset, not both (got "
                f"{prompt_file!r} and {dataset!r})"
            )
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")
        self.tokenizer_path, self.task_name, self.prompt_file = tokenizer, task, prompt_file
        self.dataset, self.max_prompt_length = dataset, max_prompt_length
        self.task: Task | None = get_task(task, **(task_args or {})) if task is not None else None
        if prompt_file is not None:
            self._file_lines = read_prompt_file(prompt_file, task, columns)
        elif dataset is not None:
            self._file_lines = load_prompt_dataset(dataset, dataset_config, split, task, columns)
        else:
            self._file_lines = []
        self.file_problems = [p for _, p in self._file_lines] if self._file_lines else None
        self.prompts_per_step, self.seed = prompts_per_step, seed
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if val_prompts < 0:
            raise ValueError(f"val_prompts must be >= 0, got {val_prompts}")
        self.val_fraction, self.val_prompts = val_fraction, val_prompts
        self.val_path = val_path
        self._file_val: list[Problem] | None = None
        if val_path is not None:  # a held-out set of one's own: nothing else is held out
            rows = _held_out_rows(val_path, dataset_config, val_split, task, columns)
            self._file_val, self.val_fraction = [p for _, p in rows][:val_prompts], 0.0
        elif self.file_problems is not None and val_fraction > 0:  # split the file once
            source = prompt_file or (dataset if isinstance(dataset, str) else "the dataset")
            total = len(self.file_problems)
            held = [p for p in self.file_problems if is_heldout(p, val_fraction)]
            self.file_problems = [p for p in self.file_problems if not is_heldout(p, val_fraction)]
            if not self.file_problems:
                raise ValueError(
                    f"every row of {source!r} is held out (val_fraction={val_fraction})"
                )
            self._file_val = held[:val_prompts]
            unused = len(held) - len(self._file_val)
            rank_zero_info(
                f"data: {len(held)} of {total} rows of {source} held out for validation "
                f"(val_fraction={val_fraction}); the held-out set is {len(self._file_val)} of "
                f"them (val_prompts={val_prompts})"
                + (f", {unused} are neither trained nor validated on" if unused else "")
                + "; data.val_path gives a held-out set of your own"
            )
        self.consumed = 0  # prompt batches handed to training (the stream position)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            if self.tokenizer_path is None:  # follow the policy's directory
                module = getattr(getattr(self, "trainer", None), "lightning_module", None)
                self.tokenizer_path = getattr(module, "policy_path", None)
                if self.tokenizer_path is None:
                    raise ValueError(
                        "RolloutDataModule needs a tokenizer directory: the policy "
                        "is not a model directory it could follow"
                    )
            path = resolve_model(
                self.tokenizer_path, what="RolloutDataModule tokenizer", require=TOKENIZER_FILE
            )
            self._tokenizer = AutoTokenizer.from_pretrained(path)
            # read by `chat.render_ids`: every chat of the run renders with these variables
            self._tokenizer.chat_template_kwargs = self.chat_template_kwargs
        return self._tokenizer

    def _rank(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return data_parallel(trainer) if trainer is not None else (0, 1)

    def problems(self, index: int) -> list[dict[str, Any]]:
        """The problems of prompt batch `index` on this data-parallel rank."""
        rank, world = self._rank()
        P = self.prompts_per_step
        if self.file_problems is None:
            rng = random.Random(f"{self.seed}/{index}/{rank}")
            return [self._training_problem(rng) for _ in range(P)]
        start = index * P * world + rank * P
        out = []
        for i in stream_positions(start, start + P, len(self.file_problems), self.seed):
            out.append(self.with_task(self.file_problems[i]))
        return out

    def with_task(self, problem: Problem) -> Problem:
        """A file's problem with the data's task where the line names none."""
        problem = dict(problem)
        if "task" not in problem and self.task_name is not None:
            problem["task"] = self.task_name
        return problem

    def _training_problem(self, rng: random.Random) -> Problem:
        assert self.task is not None  # a stream drawn from the task
        for _ in range(10_000):  # rejection: the held-out split is a fixed share of the space
            problem = self.task.sample(rng)
            if not is_heldout(problem, self.val_fraction):
                return problem
        raise ValueError(
            f"the task draws only held-out problems (val_fraction={self.val_fraction})"
        )

    def validation_problems(self) -> list[Problem]:
        """The held-out set: distinct problems of the held-out split, the same on every rank."""
        if self._file_val is not None:  # with the task, as the training stream has it
            return [self.with_task(p) for p in self._file_val]
        if self.val_prompts == 0 or self.val_fraction == 0:
            return []
        rng, out, seen = random.Random(f"{self.seed}/validation"), [], set()
        assert self.task is not None  # a held-out set drawn from the task
        for _ in range(self.val_prompts * 500):  # bounded: a small space has few held-out problems
            problem = self.task.sample(rng)
            key = problem_key(problem)
            if key not in seen and is_heldout(problem, self.val_fraction):
                seen.add(key)
                out.append(problem)
                if len(out) == self.val_prompts:
                    break
        return out

    def val_dataloader(self) -> DataLoader | list:
        """This rank's share of the held-out set, in prompt batches (equal shares on all ranks)."""
        problems = self.validation_problems()
        rank, world = self._rank()
        mine = problems[: len(problems) // world * world][rank::world]
        if not mine:
            return []
        P = self.prompts_per_step
        batches = [
            PromptBatch(-1, part, [self.prompt_ids(p) for p in part])
            for part in (mine[i : i + P] for i in range(0, len(mine), P))
        ]
        return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)  # type: ignore[arg-type]  # any sequence

    def labelled_prompts(self) -> Iterator[tuple[str, list[int]]]:
        """`(where, prompt ids)` of the prompts to check before training: every row of the
        prompt file (`file:line`) or dataset (`dataset[split] row i`), or the task's first
        prompt batch."""
        if self.file_problems is not None:
            for where, problem in self._file_lines:
                yield where, self.prompt_ids(problem)
            return
        batch = self.setup_batch()
        for j, ids in enumerate(batch.prompt_ids):
            yield f"{j} of rollout batch {batch.index} (task {self.task_name})", ids

    def setup_batch(self) -> PromptBatch:
        """The next prompt batch, drawn once for the checks before training (the prompts'
        lengths, the rows' task): a task may draw differently on a second call."""
        cached = getattr(self, "_setup_batch", None)
        if cached is None or cached.index != self.consumed:
            cached = self._setup_batch = self.prompt_batch(self.consumed)
        return cached

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The engine's prompt ids of `problem`, left-truncated to `max_prompt_length`; none
        for a problem without a chat of a task whose environment opens the chat itself
        (`Task.opens_in_environment`: its episodes start from `reset`)."""
        if (
            getattr(self.task, "opens_in_environment", False)
            and not problem.get("messages")
            and problem.get("prompt") is None
        ):
            return []
        return truncate_left(tokenize_prompt(self.tokenizer, problem), self.max_prompt_length)

    def prompt_batch(self, index: int) -> PromptBatch:
        """The `index`-th prompt batch of the stream."""
        problems = self.problems(index)
        return PromptBatch(index, problems, [self.prompt_ids(p) for p in problems])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            PromptStream(self, self.consumed), batch_size=None, collate_fn=lambda b: b
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "prompts_per_step": self.prompts_per_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved stream position (in prompt batches); a seed or
        prompts_per_step other than the checkpoint's is honoured, one line each (the stream
        then differs from the checkpoint's from here on)."""
        self.consumed = int(state["consumed"])
        lines = [
            resume_line(f"data {key}", getattr(self, key), state[key])
            for key in ("seed", "prompts_per_step")
            if key in state and state[key] != getattr(self, key)
        ]
        Differences(lines, []).report()


def _held_out_rows(
    path: Any, config: str | None, split: str, task: str | None, columns: dict[str, str] | None
) -> list[tuple[str, Problem]]:
    """The rows of `val_path`: a JSONL prompt file, a local data file (its one split), a hub
    dataset or directory (`split`), or a `Dataset` object."""
    import os

    if isinstance(path, str) and path.endswith(".jsonl") and os.path.isfile(path):
        return read_prompt_file(path, task, columns)
    local = isinstance(path, str) and os.path.isfile(path)
    return load_prompt_dataset(path, config, "train" if local else split, task, columns)

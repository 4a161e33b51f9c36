"""`PromptBatch`: one step's prompts, as the data module yields them.

The rollout callback turns it into the step's `RolloutBatch` (set as `rollout`) before the
training step; on the held-out set, it sets the evaluation's figures (`val`) before the
validation step. Lightning moves it to the device as it moves any dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_lightning.protocols.batch import RolloutBatch


@dataclass
class PromptBatch:
    """One step's prompts.

    Attributes:
        index: the rollout batch's position in the prompt stream (-1: a held-out batch).
        problems: the problems (a task's dicts: `prompt` or `messages`, `answer`, ...).
        prompt_ids: each problem's prompt ids, as the engine reads them.
        rollout: the step's rollout batch, once the rollout callback has built it.
        val: the held-out figures of the batch, once evaluated (`rollout.validation`).
    """

    index: int
    problems: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    rollout: RolloutBatch | None = None
    val: Any = None

    def group_of(self, problem: int) -> int:
        """The group id of the `problem`-th problem: unique over the run's rollout batches."""
        return int(self.index) * len(self.prompt_ids) + problem

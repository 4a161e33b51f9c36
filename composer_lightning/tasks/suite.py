"""The sparse-reward suite: tasks the shipped tiny policy almost never solves alone (≤ 2 % per
sample at the suite's training temperature) but often solves with the verifier's own hint in
context (≥ 30 %), each a different reason for the sparsity.

Every figure is measured on the shipped policy (`composer_lightning/assets/tiny_policy`) by
`bench/sparse_suite.py`, which re-measures them all and writes `docs/sparse_suite.json`;
`tests/tasks/test_suite.py` checks that the two agree and that the thresholds hold. Figures,
over `PROBLEMS` problems drawn with `task.samples(PROBLEMS, seed=PROBLEM_SEED)` (with repeats
where the problem space is smaller), one completion each (`build_tiny.hint_accuracy`, sampling
seed `SAMPLE_SEED`):
- `plain_greedy`, `hinted_greedy`: greedy accuracy alone and with the hint the verifier gives
  for the policy's own greedy answer (`verify(...).hint`) as an extra user message;
- `plain_sampled`, `hinted_sampled`: the same sampled at `temperature` (the hint is the one for
  the policy's own sampled answer, as in training);
- `first_rank_median`, `first_prob_mean`, `first_prob_median`: rank (1 = the policy's first
  choice) and probability at `temperature` of the right answer's first token after the plain
  prompt;
- `hardest_rank_median`, `hardest_prob_mean`: the same for the right answer's least likely
  token, the right answer's earlier tokens given (the token sampling has to get past).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from composer_lightning.tasks.base import Task
from composer_lightning.tasks.registry import get_task

PROBLEMS = 1000
PROBLEM_SEED = 1234
SAMPLE_SEED = 7
#: The suite's definition of sparse: at most this plain success per sample...
MAX_PLAIN_SAMPLED = 0.02
#: ...and at least this success with the verifier's hint in context.
MIN_HINTED_SAMPLED = 0.30

FIGURES = (
    "plain_greedy",
    "hinted_greedy",
    "plain_sampled",
    "hinted_sampled",
    "first_rank_median",
    "first_prob_mean",
    "first_prob_median",
    "hardest_rank_median",
    "hardest_prob_mean",
)


@dataclass(frozen=True)
class SparseTask:
    """One task of the suite.

    Attributes:
        kind: one line: why the plain policy fails and what the hint gives it.
        task: the task's short name or class path (`tasks/registry.py`).
        task_args: the task's constructor arguments (JSON values, as the CLI passes them).
        temperature: the sampling temperature training uses on this task.
        figures: the measured figures (see the module docstring), name → value.
    """

    kind: str
    task: str
    task_args: dict[str, Any]
    temperature: float
    figures: dict[str, float] = field(default_factory=dict)

    def build(self) -> Task:
        """The task instance."""
        return get_task(self.task, **self.task_args)

    def fit_args(self) -> list[str]:
        """`python -m composer_lightning fit` overrides that train on this task."""
        return [
            f"--data.init_args.task={self.task}",
            f"--data.init_args.task_args={json.dumps(self.task_args)}",
            f"--rollout.sampling.temperature={self.temperature}",
        ]


SUITE: dict[str, SparseTask] = {
    "carry": SparseTask(
        kind="a systematic slip: the policy forgets the units carry, the right first token is "
        "its second choice, and the hint names it",
        task="arithmetic",
        task_args={"carry_only": True},
        temperature=0.3,
        figures={
            "plain_greedy": 0.0,
            "hinted_greedy": 1.0,
            "plain_sampled": 0.017,
            "hinted_sampled": 0.99,
            "first_rank_median": 2.0,
            "first_prob_mean": 0.0509,
            "first_prob_median": 0.00417,
            "hardest_rank_median": 2.0,
            "hardest_prob_mean": 0.00994,
        },
    ),
    "subtract": SparseTask(
        kind="an operator the policy never learnt (it adds): the right first token is far "
        "down, and the hint's digit is most often the whole answer",
        task="arithmetic",
        task_args={"ops": ["-"], "min_value": 6},
        temperature=0.5,
        figures={
            "plain_greedy": 0.0,
            "hinted_greedy": 0.418,
            "plain_sampled": 0.0,
            "hinted_sampled": 0.417,
            "first_rank_median": 4.0,
            "first_prob_mean": 0.181,
            "first_prob_median": 8.03e-08,
            "hardest_rank_median": 5.0,
            "hardest_prob_mean": 0.103,
        },
    ),
    "multiply": SparseTask(
        kind="answers the policy cannot compute (it adds): the hint gives one digit of two, so "
        "the hinted policy, the teacher, is right only about a third of the time",
        task="arithmetic",
        task_args={"ops": ["*"], "max_value": 12},
        temperature=1.0,
        figures={
            "plain_greedy": 0.0,
            "hinted_greedy": 0.343,
            "plain_sampled": 0.0,
            "hinted_sampled": 0.337,
            "first_rank_median": 3.0,
            "first_prob_mean": 0.102,
            "first_prob_median": 0.000473,
            "hardest_rank_median": 6.0,
            "hardest_prob_mean": 0.0116,
        },
    ),
}

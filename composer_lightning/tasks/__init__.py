"""Tasks (problems + verifiers) and the score / hint providers of the rollout side.

Owns: the `Task` and provider contracts (`base.py`), the lookup of tasks by name
(`registry.py`), the verifier as provider and the reference answer as hint (`verifiers.py`), other hints (`hints.py`), reward
functions (`rewards.py`), LLM judges (`judge.py`), explicit feedback (`feedback.py`) and the
built-in tasks (OpenEnv's as `openenv.py`).
May import: `functional`, `runtime`, `models`, `engines` (a judge's), `chat`, `envs`.
"""

from composer_lightning.tasks.arithmetic import Arithmetic
from composer_lightning.tasks.base import (
    HintProvider,
    Problem,
    ScoreProvider,
    ScoringError,
    Task,
    Verdict,
)
from composer_lightning.tasks.hints import EpisodeHint, FunctionHint, ToolErrorHint
from composer_lightning.tasks.registry import BUILTIN_TASKS, get_task
from composer_lightning.tasks.reverse import ReverseDigits
from composer_lightning.tasks.rewards import FunctionScore
from composer_lightning.tasks.verifiers import AnswerHint, VerifierHint, VerifierScore

__all__ = [
    "BUILTIN_TASKS",
    "AnswerHint",
    "Arithmetic",
    "EpisodeHint",
    "FunctionHint",
    "FunctionScore",
    "HintProvider",
    "LLMJudgeHint",
    "LLMJudgeScore",
    "Problem",
    "ReverseDigits",
    "ScoreProvider",
    "ScoringError",
    "Task",
    "ToolCalc",
    "ToolErrorHint",
    "NextStateJudgeHint",
    "NextStateJudgeScore",
    "Verdict",
    "VerifierHint",
    "VerifierScore",
    "get_task",
]


def __getattr__(name: str):  # the judge (engine contract) and tool_calc (transformers): lazy
    if name in (
        "LLMJudgeScore",
        "LLMJudgeHint",
        "NextStateJudgeHint",
        "NextStateJudgeScore",
    ):
        from composer_lightning.tasks import judge

        return getattr(judge, name)
    if name == "ToolCalc":
        from composer_lightning.tasks.tool_calc import ToolCalc

        return ToolCalc
    raise AttributeError(name)

"""Tasks (problems + verifiers) and the score / hint providers of the rollout side."""

from composer_lightning.tasks.arithmetic import Arithmetic
from composer_lightning.tasks.base import (
    FunctionHint,
    HintProvider,
    Problem,
    ScoreProvider,
    ScoringError,
    Task,
    ToolErrorHint,
    Verdict,
    VerifierHint,
    VerifierScore,
)
from composer_lightning.tasks.registry import BUILTIN_TASKS, get_task
from composer_lightning.tasks.reverse import ReverseDigits
from composer_lightning.tasks.rewards import FunctionScore

__all__ = [
    "BUILTIN_TASKS",
    "Arithmetic",
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

"""Math answer checking with `math-verify`, as TRL users and open-r1 do it (the `math` extra).

`accuracy_reward` is open-r1's (`src/open_r1/rewards.py`, huggingface/open-r1 at 1416fa0): the
gold solution parsed with `math_verify.parse` (first match), the completion parsed with a
`LatexExtractionConfig` that tries `\\boxed{}` first and wants an anchored answer, then
`verify(gold, answer)`: 1.0 or 0.0, None (no score) when the gold cannot be parsed or `verify`
raises. Differences: a completion may be a string (standard format) or open-r1's
`[{"role": "assistant", "content": ...}]`; GSM8K golds (`"... #### 72"`) parse as they are
(`parse` finds the 72); the `NormalizationConfig` omits `equations=True` (deprecated in
math-verify 0.9, which handles equations in the parser). math-verify bounds its own time with
`signal.alarm`, which works only in the main thread: under `FunctionScore`'s timeout (a
worker thread) its timeouts are off and `FunctionScore`'s bounds the call instead.

YAML: `score: {class_path: composer_lightning.tasks.FunctionScore, init_args: {fn:
composer_lightning.tasks.math.accuracy_reward}}` with a `solution` column (map GSM8K's with
`columns: {question: prompt, answer: solution}`).
"""

from __future__ import annotations

import threading
from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def accuracy_reward(
    completions: list[Any], solution: list[str], **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion's answer equals the gold `solution`, 0.0 where not, None where
    the gold cannot be parsed (TRL's batched reward signature)."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError(
            "composer_lightning.tasks.math needs math-verify: pip install "
            "'composer-lightning[math]'"
        ) from None
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    answer_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
            ),
            boxed_match_priority=0,  # \boxed{} first
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution, strict=True):
        gold_parsed = parse(str(gold), extraction_mode="first_match", parsing_timeout=limit)
        if not gold_parsed:
            rewards.append(None)  # an unparsable gold: skip the sample, as open-r1 does
            continue
        answer = parse(
            _text(completion),
            extraction_config=answer_config,
            extraction_mode="first_match",
            parsing_timeout=limit,
        )
        try:
            rewards.append(float(verify(gold_parsed, answer, timeout_seconds=limit)))
        except Exception:  # open-r1: a verify that raises gives no score
            rewards.append(None)
    return rewards

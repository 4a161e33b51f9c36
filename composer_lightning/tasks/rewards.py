"""`FunctionScore`: rewards from plain functions, in this library's form or as TRL users write them.

Two forms of reward function:
- per sample, `fn(problem, completion) -> float | None`: called once per completion, each call
  under `timeout`;
- batched, TRL's `fn(prompts, completions, **kwargs) -> list[float | None]` (the convention of
  `GRPOTrainer._calculate_rewards`, TRL 1.16): called once per rollout batch, the whole call
  under one `timeout`. It receives `prompts` (a problem's `"prompt"`, a string or a chat, else
  its `"messages"`), `completions` (strings; for a chat prompt, `[{"role": "assistant",
  "content": text}]` each, as TRL gives them), `completion_ids` (token ids, in training and
  validation alike; None where a caller has none), every other field of the problems by name (dataset
  columns such as `answer` or `solution`, one value per completion), `trainer_state=None`
  (the provider does not see the trainer) and no-op `log_extra` / `log_metric`.

`batched=None` tells the forms apart by the signature: a function with a parameter named
`prompts` or `completions` is batched (TRL's names), any other is per sample; `batched=True` /
`False` says it outright.

Several functions combine as TRL combines them: `Σ_j w_j · r_j` over the functions that gave a
score (a None is skipped, TRL's `nansum`), `reward_weights` all 1 by default; a sample no
function scored gets no score. `None` is "no score" (the sample gets `has_reward=False`), not a
failure. A failure is a call that raises, times out, returns the wrong number of values, or a
value that is not a finite number (NaN, a string): the samples concerned get no score, one
warning line, and count in `failures`; with several functions a sample fails when any of them
failed on it (a partial sum would change the reward's scale without a word).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from composer_lightning.runtime.calls import as_reward, call_batch, call_each, check_timeout
from composer_lightning.tasks.base import DEFAULT_TIMEOUT, Problem, ScoreProvider

logger = logging.getLogger(__name__)

#: Problem fields TRL does not pass to reward functions as columns.
_NOT_COLUMNS = ("prompt", "completion", "completion_ids")


def takes_batches(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is a TRL-style batched reward function: it has a parameter named `prompts`
    or `completions`. A signature that cannot be read counts as per sample."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "prompts" in params or "completions" in params


def weighted_rewards(
    values: Sequence[Sequence[float | None]], weights: Sequence[float]
) -> list[float | None]:
    """Per sample, `Σ_j weights[j] · values[j][i]` over the functions j with a value (TRL's
    `nansum` over reward functions); None where no function gave one.

    Args:
        values: `[F][N]`, one list per function, None where it gave no score.
        weights: `[F]`.
    """
    out: list[float | None] = []
    for column in zip(*values, strict=True):
        given = [(w, v) for w, v in zip(weights, column, strict=True) if v is not None]
        out.append(sum(w * v for w, v in given) if given else None)
    return out


def trl_inputs(
    problems: Sequence[Problem], completions: Sequence[str], completion_ids: Sequence[Any] | None
) -> dict[str, Any]:
    """The keyword arguments of a batched (TRL) reward function for one batch (see above)."""
    prompts = [p["prompt"] if "prompt" in p else p.get("messages") for p in problems]
    out: dict[str, Any] = {
        "prompts": prompts,
        "completions": [
            [{"role": "assistant", "content": c}] if isinstance(p, list) else c
            for p, c in zip(prompts, completions, strict=True)
        ],
        "completion_ids": list(completion_ids) if completion_ids is not None else None,
    }
    columns = dict.fromkeys(k for p in problems for k in p if k not in _NOT_COLUMNS)
    out.update({k: [p.get(k) for p in problems] for k in columns})
    out["trainer_state"] = None
    out["log_extra"] = out["log_metric"] = _ignore  # TRL logs through these; here they are no-ops
    return out


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _number_or_none(value: Any) -> tuple[float | None]:
    """A reward as a 1-tuple (so that a failure, None, differs from "no score", `(None,)`)."""
    return (None if value is None else as_reward(value),)


class FunctionScore(ScoreProvider):
    """Scores with reward functions: per sample `fn(problem, completion)` or TRL's batched
    `fn(prompts, completions, **kwargs)`, one function or several with `reward_weights` (see
    `composer_lightning.tasks.rewards`).

    Any finite number (bool, int, float, or a 0-d array of one) is used as it is (group
    advantages need no [0, 1] range); `clip` bounds the combined reward when asked. None is no
    score; a raising, timed-out or malformed call fails its samples (one warning line, counted
    in `failures`).

    Args:
        fn: the reward function, or a list of them (each a callable or, in YAML, a dotted path).
        clip: optional `(low, high)` bounds the combined rewards are clipped to.
        timeout: seconds one call may take (a per-sample call, or a whole batched call) before
            its samples get no score (the call runs on in a background thread, see
            `runtime/calls.py`); None: no limit, and calls run in the training loop's thread.
        reward_weights: one weight per function (TRL's `reward_weights`); None: all 1.
        batched: True: every function is TRL-style batched; False: every one is per sample;
            None: each function's form from its signature (`takes_batches`).
    """

    def __init__(
        self,
        fn: list[Callable[..., Any]] | Callable[..., Any],  # list first: jsonargparse dumps it
        clip: tuple[float, float] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        reward_weights: list[float] | None = None,
        batched: bool | None = None,
    ) -> None:
        if clip is not None and not clip[0] <= clip[1]:
            raise ValueError(
                f"FunctionScore: clip must be (low, high) with low <= high, got {clip}"
            )
        fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
        if not fns or not all(callable(f) for f in fns):
            raise ValueError(f"FunctionScore: fn must be a callable or a list of them, got {fn!r}")
        weights = [1.0] * len(fns) if reward_weights is None else list(reward_weights)
        if len(weights) != len(fns) or not all(
            isinstance(w, (int, float)) and math.isfinite(w) for w in weights
        ):
            raise ValueError(
                f"FunctionScore: reward_weights must be {len(fns)} finite numbers (one per "
                f"reward function), got {reward_weights!r}"
            )
        self.fns, self.reward_weights, self.clip = fns, [float(w) for w in weights], clip
        self.batched = [takes_batches(f) if batched is None else bool(batched) for f in fns]
        self.timeout = check_timeout(timeout, "FunctionScore")
        self.failures = 0

    @property
    def fn(self) -> Callable[..., Any]:
        """The first (with one function, the only) reward function."""
        return self.fns[0]

    def score(
        self,
        problems: list[Problem],
        completions: list[str],
        completion_ids: list[list[int]] | None = None,
    ) -> list[float | None]:
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        n = len(problems)
        failed = [False] * n
        values: list[list[float | None]] = []
        for fn, batched in zip(self.fns, self.batched, strict=True):
            subject = "reward function" + (
                f" {getattr(fn, '__name__', type(fn).__name__)}" if len(self.fns) > 1 else ""
            )
            if batched:
                raw = call_batch(
                    fn,
                    trl_inputs(problems, completions, completion_ids),
                    n,
                    self.timeout,
                    subject,
                    "no sample of it gets a score",
                )
                boxed, _ = (
                    call_each(
                        lambda value, _: value,
                        raw,
                        completions,
                        None,
                        subject,
                        "it gets no score",
                        _number_or_none,
                    )
                    if raw is not None
                    else ([None] * n, n)
                )
            else:
                boxed, _ = call_each(
                    fn,
                    problems,
                    completions,
                    self.timeout,
                    subject,
                    "it gets no score",
                    _number_or_none,
                )
            failed = [f or b is None for f, b in zip(failed, boxed, strict=True)]
            values.append([None if b is None else b[0] for b in boxed])
        scores = [
            None if bad else s
            for bad, s in zip(failed, weighted_rewards(values, self.reward_weights), strict=True)
        ]
        self.failures += sum(failed)
        unscored = sum(s is None and not bad for s, bad in zip(scores, failed, strict=True))
        if unscored:  # as TRL warns: no function gave these samples a score
            logger.warning(
                "%d of %d samples: every reward function returned None (they get no score)",
                unscored,
                n,
            )
        if self.clip is None:
            return scores
        low, high = self.clip
        return [None if v is None else min(high, max(low, v)) for v in scores]

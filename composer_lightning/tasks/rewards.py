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
  columns such as `answer` or `solution`, one value per completion), `trainer_state` (a
  `TrainerState`: `global_step`, `epoch`, `max_steps`, as TRL passes transformers' state, set
  by the rollout callback before each batch), `log_metric(name, value)` (the step logs the
  mean of a name's values) and `log_extra(column, values)` (one value per completion, shown
  in `rollouts.jsonl`'s rows). An `async def` function is awaited; the batch's async functions
  run concurrently (`asyncio.gather`, as TRL 1.16), under one `timeout` for all of them.

Each function's scores of a batch are logged as `rewards/<function name>/mean` and `/std`
(over the samples it scored, as TRL logs them).

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

import asyncio
import inspect
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from composer_lightning.runtime.calls import (
    CallTimeout,
    as_reward,
    call_batch,
    call_each,
    call_with_timeout,
    check_timeout,
)
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


@dataclass
class TrainerState:
    """What a reward function reads of TRL's `trainer_state` (transformers' `TrainerState`):
    the optimizer steps done, the epoch, the run's `max_steps` (-1: no limit)."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = -1


def trl_inputs(
    problems: Sequence[Problem],
    completions: Sequence[str],
    completion_ids: Sequence[Any] | None,
    trainer_state: TrainerState | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list[Any]], None] | None = None,
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
    out["trainer_state"] = trainer_state if trainer_state is not None else TrainerState()
    out["log_metric"] = log_metric or _ignore
    out["log_extra"] = log_extra or _ignore
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
        self.batched = [
            takes_batches(f) or inspect.iscoroutinefunction(f) if batched is None else bool(batched)
            for f in fns
        ]
        for f, b in zip(fns, self.batched, strict=True):
            if inspect.iscoroutinefunction(f) and not b:
                raise ValueError(
                    f"FunctionScore: async reward function {_name(f)} must be batched (TRL's "
                    "form, fn(prompts, completions, **kwargs)); per sample it would be awaited "
                    "one completion at a time"
                )
        self.timeout = check_timeout(timeout, "FunctionScore")
        self.failures = 0
        self.trainer_state = TrainerState()  # the rollout callback keeps it current
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._extra: dict[str, list[Any]] = defaultdict(list)
        self._components: list[list[float | None]] | None = None

    def pop_metrics(self) -> dict[str, tuple[float, float]]:
        """What was logged since the last call, each as `(mean, weight)`: every function's
        `rewards/<name>/mean` and `/std` over the samples it scored (weight: their number),
        and each `log_metric` name's mean over its calls (weight: the calls)."""
        out: dict[str, tuple[float, float]] = {}
        for name, values in self._metrics.items():
            if name.startswith("rewards/"):
                mean = sum(values) / len(values)
                std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
                out[f"{name}/mean"], out[f"{name}/std"] = (mean, len(values)), (std, len(values))
            else:
                out[name] = (sum(values) / len(values), float(len(values)))
        self._metrics.clear()
        return out

    def pop_components(self) -> tuple[list[list[float | None]], list[float]] | None:
        """Each function's value per sample of the last `score` call (None where it gave
        none) and the `reward_weights`, once: what `DrGRPOHead(multi_objective_aggregation=
        "normalize_then_sum")` (GDPO) normalises one function at a time. None before a call."""
        components, self._components = self._components, None
        return None if components is None else (components, list(self.reward_weights))

    def pop_extra(self) -> dict[str, list[Any]]:
        """The `log_extra` columns since the last call (one value per completion scored)."""
        out = dict(self._extra)
        self._extra.clear()
        return out

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[str(name)].append(float(value))

    def _log_extra(self, column: str, values: list[Any]) -> None:
        self._extra[str(column)].extend(values)

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
        inputs = (  # the batched functions' keyword arguments, built once for all of them
            trl_inputs(
                problems,
                completions,
                completion_ids,
                self.trainer_state,
                self._log_metric,
                self._log_extra,
            )
            if any(self.batched)
            else {}
        )
        awaited = self._await_all(inputs, n)
        for fn, batched in zip(self.fns, self.batched, strict=True):
            subject = "reward function" + (f" {_name(fn)}" if len(self.fns) > 1 else "")
            if batched:
                raw = call_batch(
                    awaited[id(fn)] if id(fn) in awaited else fn,
                    {} if id(fn) in awaited else inputs,
                    n,
                    None if id(fn) in awaited else self.timeout,
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
            scored = [b[0] for b in boxed if b is not None and b[0] is not None]
            if scored:
                self._metrics[f"rewards/{_name(fn)}"].extend(scored)
        # each function's own value per sample, for GDPO's per-function normalisation
        self._components = [list(per_sample) for per_sample in zip(*values, strict=True)]
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

    def _await_all(self, inputs: dict[str, Any], n: int) -> dict[int, Callable[[], Any]]:
        """Await the batch's async functions together (TRL's `asyncio.gather`), under one
        timeout for all; per function (by id), a call that returns its result or raises its
        error, for `call_batch` to check as it checks a plain function's call."""
        coroutines = [f for f in self.fns if inspect.iscoroutinefunction(f)]
        if not coroutines:
            return {}

        def gather() -> list[Any]:
            async def run() -> list[Any]:
                calls = (f(**inputs) for f in coroutines)
                return await asyncio.gather(*calls, return_exceptions=True)

            return asyncio.run(run())

        try:
            results = call_with_timeout(gather, (), self.timeout)
        except CallTimeout:
            why = f"not done after {self.timeout:g} s (the batch's async functions together)"
            results = [TimeoutError(why)] * len(coroutines)
        return {id(f): _replay(r) for f, r in zip(coroutines, results, strict=True)}


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _replay(result: Any) -> Callable[[], Any]:
    def call() -> Any:
        if isinstance(result, BaseException):
            raise result
        return result

    return call

"""Score and hint providers called on a batch, checked per sample.

Score and hint providers fail per sample, alike: a provider call that raises as a whole, or
returns a value that is not a score (a finite number or None) or a hint (a string or None), is
a failure of the samples concerned — one warning line each, counted — never a crashed batch.
Used by the dispatch, held-out evaluation and the serving judge.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from composer_lightning.runtime.calls import BadValue, as_hint, as_reward
from composer_lightning.tasks.base import HintProvider, ScoreProvider

log = logging.getLogger(__name__)


def provider_values(
    provider: ScoreProvider | HintProvider,
    kind: str,
    problems: list[dict[str, Any]],
    completions: list[str],
    completion_ids: list[list[int]] | None = None,
) -> tuple[list[Any], int]:
    """A provider's scores (`kind="score"`) or hints (`kind="hint"`) of one batch, checked.

    `completion_ids` go to a provider whose method takes a `completion_ids` argument
    (`FunctionScore`, for TRL-style reward functions); others get problems and texts only.

    Returns:
        One value per sample (None where it failed), and the number of failed samples: those
        the provider counted in its `failures` (reset here), plus every sample of a call that
        raised or returned the wrong number of values, plus each value of the wrong type.
    """
    n, name = len(problems), type(provider).__name__
    call = getattr(provider, "score" if kind == "score" else "hints")
    extra = {"completion_ids": completion_ids} if _takes(call, "completion_ids") else {}
    try:
        values = list(call(problems, completions, **extra))
    except Exception as exc:  # a broken provider fails its samples, not the run
        log.warning(
            "%s provider %s raised on the whole batch (no sample gets a %s): %s: %s",
            kind,
            name,
            kind,
            type(exc).__name__,
            exc,
        )
        values = [None] * n
        failed = n
    else:
        failed = 0
        if len(values) != n:
            log.warning(
                "%s provider %s returned %d values for %d samples (no sample gets a %s)",
                kind,
                name,
                len(values),
                n,
                kind,
            )
            values, failed = [None] * n, n
    failed = max(failed, min(n, int(getattr(provider, "failures", 0) or 0)))
    if getattr(provider, "failures", 0):
        provider.failures = 0
    convert = as_reward if kind == "score" else as_hint
    out = []
    for i, value in enumerate(values):
        try:
            out.append(None if value is None else convert(value))
        except BadValue as exc:
            failed += 1
            log.warning(
                "%s provider %s returned %s on sample %d, expected %s (it gets no %s)",
                kind,
                name,
                exc.got,
                i,
                exc.expected,
                kind,
            )
            out.append(None)
    return out, min(failed, n)


def provider_logs(provider: Any) -> tuple[dict[str, tuple[float, float]], dict[str, list[Any]]]:
    """What a provider logged since it was last asked (`FunctionScore`'s per-function rewards,
    its reward functions' `log_metric` and `log_extra`): metrics as `(mean, weight)`, extra
    columns one value per sample scored. Empty for a provider that logs nothing."""
    pop_metrics = getattr(provider, "pop_metrics", None)
    pop_extra = getattr(provider, "pop_extra", None)
    return (
        pop_metrics() if callable(pop_metrics) else {},
        pop_extra() if callable(pop_extra) else {},
    )


def provider_components(provider: Any) -> tuple[list[list[float | None]], list[float]] | None:
    """Each reward function's value per sample of the provider's last batch and its weights
    (`FunctionScore.pop_components`), for GDPO; None for a provider without them."""
    pop = getattr(provider, "pop_components", None)
    return pop() if callable(pop) else None


def share_trainer_state(providers: list[Any], trainer: Any) -> None:
    """Give each provider that reads it (`trainer_state`, TRL's reward-function argument) the
    trainer's step, epoch and `max_steps`, before it scores a batch."""
    for provider in providers:
        state = getattr(provider, "trainer_state", None)
        if state is not None:
            state.global_step = int(trainer.global_step)
            state.epoch = float(trainer.current_epoch)
            state.max_steps = int(trainer.max_steps)


def _takes(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False

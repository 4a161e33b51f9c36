"""Calls of user code (reward functions, verifiers, hint functions) under a timeout.

Each call runs on a daemon thread of its own while the training loop waits at most `timeout`
seconds for it. A call that takes longer is a failure of its sample (one warning line, counted
like a raising call) and the loop goes on with the next sample. A batched call (`call_batch`,
TRL-style reward functions) has one timeout for the whole batch and fails all its samples.

A thread cannot be killed: a call that times out keeps running in the background until it
returns, and its result is then dropped; a call that never returns keeps its thread for the
life of the process (a daemon thread: it does not hold up the exit). A function that holds the
interpreter lock without releasing it (a C extension in a long loop) slows the training loop
while it runs; such a function must bound its own time. `timeout=None` runs the call in the
caller's thread with no limit (for code that needs the main thread, e.g. `signal.alarm`).
`call_all` runs independent calls (the environments of different episodes) side by side, each
under its own timeout.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


class CallTimeout(TimeoutError):
    """A call did not return within its timeout (it may still be running, see above)."""


def check_timeout(timeout: float | None, owner: str) -> float | None:
    """`timeout` as a float, or a ValueError naming `owner` unless it is > 0 or None."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{owner}: timeout must be > 0 seconds or None, got {timeout!r}")
    return float(timeout)


def check_workers(workers: int, owner: str) -> int:
    """`workers` (an int >= 1), or a ValueError naming `owner`."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(
            f"{owner}: must be an integer >= 1 (1: one call at a time), got {workers!r}"
        )
    return workers


def call_with_timeout(
    fn: Callable[..., Any],
    args: Sequence[Any],
    timeout: float | None,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """`fn(*args, **kwargs)`, or `CallTimeout` once it has run `timeout` seconds (None: no
    limit).

    Raises:
        CallTimeout: the call is still running. Whatever `fn` raised, re-raised.
    """
    kwargs = kwargs or {}
    if timeout is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    name = getattr(fn, "__name__", type(fn).__name__)
    thread = threading.Thread(target=run, name=f"composer-call-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallTimeout(f"no result after {timeout:g} s (the call runs on in the background)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_all(
    calls: list[tuple[Callable[..., Any], tuple[Any, ...], float | None]], workers: int
) -> list[tuple[Any, Exception | None]]:
    """Each `fn(*args)` under its timeout, the calls with a timeout up to `workers` at a time
    (environments of different episodes are independent: their waits overlap); `(value,
    None)` or `(None, the error)` per call, in order. A call without a timeout (a single turn)
    runs in the caller's thread."""

    def one(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float | None) -> Any:
        try:
            return call_with_timeout(fn, args, timeout), None
        except Exception as exc:  # the episode's failure, not the batch's
            return None, exc

    timed = [k for k, (_, _, timeout) in enumerate(calls) if timeout is not None]
    out: list[Any] = [None] * len(calls)
    if workers > 1 and len(timed) > 1:
        with ThreadPoolExecutor(min(workers, len(timed)), "composer-env") as pool:
            for k, result in zip(timed, pool.map(lambda k: one(*calls[k]), timed), strict=True):
                out[k] = result
    for k, call in enumerate(calls):
        if out[k] is None:
            out[k] = one(*call)
    return out


def call_batch(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    n: int,
    timeout: float | None,
    subject: str,
    consequence: str,
) -> list[Any] | None:
    """`fn(**kwargs)` once for a batch of `n` samples, under one `timeout` for the whole call.

    Returns:
        The `n` values as the call returned them, or None when the call raised, timed out or
        did not return a list of `n` values: then every sample of the batch failed, and one
        warning line says why (`<subject> raised on a batch of 8 samples (<consequence>): ...`).
    """
    try:
        values = call_with_timeout(fn, (), timeout, kwargs)
    except CallTimeout:
        why = f"timed out after {timeout:g} s (the call runs on in the background)"
    except Exception as exc:  # a broken function must not crash the batch
        why = f"raised {type(exc).__name__}: {exc}"
    else:
        if isinstance(values, (list, tuple)) and len(values) == n:
            return list(values)
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)[:80]
        why = f"returned {got}, expected a list of {n} values (one per completion)"
    logger.warning("%s %s on a batch of %d samples (%s)", subject, why, n, consequence)
    return None


class BadValue(ValueError):
    """A function returned something its caller cannot use."""

    def __init__(self, got: str, expected: str):
        super().__init__(f"returned {got}, expected {expected}")
        self.got, self.expected = got, expected


def as_reward(value: Any) -> float:
    """A reward function's value as a float: a finite bool, int or float (a 0-d array or tensor
    of one counts too); `BadValue` saying what it got otherwise (None, NaN, a string, ...)."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()  # numpy scalars, 0-d tensors
    if not isinstance(value, numbers.Real):
        raise BadValue(f"{type(value).__name__} {value!r}", "a number (bool, int or float)")
    value = float(value)
    if not math.isfinite(value):
        raise BadValue(str(value), "a finite number")
    return value


def as_hint(value: Any) -> str | list[str] | None:
    """A hint function's value: a string, a list of candidate hints (strings; the first is the
    hint, all are candidates for top-k OPD's hint selection; an empty list is None) or None;
    `BadValue` saying what it got otherwise."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value) or None
    raise BadValue(f"{type(value).__name__} {value!r}", "a string, a list of strings or None")


def hint_candidates(value: str | list[str] | None) -> list[str]:
    """A hint value as its candidates: [] for None, [hint] for one hint (duplicates dropped,
    the first kept)."""
    if value is None:
        return []
    return list(dict.fromkeys([value] if isinstance(value, str) else value))


def call_each(
    fn: Callable[[Any, str], Any],
    problems: Sequence[Any],
    completions: Sequence[str],
    timeout: float | None,
    subject: str,
    consequence: str,
    convert: Callable[[Any], Any] = lambda v: v,
) -> tuple[list[Any], int]:
    """`convert(fn(problem, completion))` for each pair, each call under `timeout`.

    A call that raises, times out or returns what `convert` refuses (`BadValue`) gives None for
    its sample and one warning line naming the sample: `<subject> raised on sample 3
    (<consequence>): KeyError: 'x'`.

    Args:
        subject: what is called, e.g. "reward function".
        consequence: what a failure means for the sample, e.g. "it gets no score".

    Returns:
        The values, and how many calls failed.
    """
    out: list[Any] = []
    failures = 0
    for i, (problem, completion) in enumerate(zip(problems, completions, strict=True)):
        try:
            out.append(convert(call_with_timeout(fn, (problem, completion), timeout)))
            continue
        except CallTimeout:
            logger.warning(
                "%s timed out on sample %d after %g s (%s; the call runs on in the background)",
                subject,
                i,
                timeout,
                consequence,
            )
        except BadValue as exc:
            logger.warning(
                "%s returned %s on sample %d, expected %s (%s)",
                subject,
                exc.got,
                i,
                exc.expected,
                consequence,
            )
        except Exception as exc:  # a broken function must not crash the batch
            logger.warning(
                "%s raised on sample %d (%s): %s: %s",
                subject,
                i,
                consequence,
                type(exc).__name__,
                exc,
            )
        failures += 1
        out.append(None)
    return out, failures

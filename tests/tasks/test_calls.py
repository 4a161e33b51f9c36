"""Reward, verifier and hint calls: numbers only, and a timeout per call (`runtime/calls.py`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from composer_lightning.tasks import FunctionHint, FunctionScore, Task, Verdict, VerifierScore


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_reward_must_be_a_number_not_a_string_or_nan_and_none_is_no_score(caplog):
    """None is "no score" (as in TRL), not a failure: not counted, no per-sample line."""
    values = ["1", None, float("nan"), True, np.float32(0.5), torch.tensor(0.25), 2]
    scorer = FunctionScore(lambda problem, completion: values[int(completion)])
    with caplog.at_level("WARNING"):
        out = scorer.score([{}] * len(values), [str(i) for i in range(len(values))])
    assert out == [None, None, None, 1.0, 0.5, 0.25, 2.0]
    assert scorer.failures == 2
    assert _messages(caplog) == [
        "reward function returned str '1' on sample 0, expected a number (bool, int or float) "
        "(it gets no score)",
        "reward function returned nan on sample 2, expected a finite number (it gets no score)",
        "1 of 7 samples: every reward function returned None (they get no score)",
    ]


class _Hangs:
    """A function that never returns on completion "hang" (until released, so that a broken
    timeout fails the test instead of hanging it)."""

    def __init__(self, value):
        self.value, self.release = value, threading.Event()

    def __call__(self, problem, completion):
        if completion == "hang":
            self.release.wait(30)
            return "late"
        return self.value


class _HangingTask(Task):
    name = "hanging"

    def __init__(self):
        self.fn = _Hangs(Verdict(1.0))

    def sample(self, rng):
        return {"task": self.name, "messages": []}

    def verify(self, problem, completion):
        return self.fn(problem, completion)


@pytest.mark.parametrize("kind", ["function score", "verifier score", "function hint"])
def test_a_call_that_hangs_times_out_as_a_failure_of_its_sample_and_the_batch_goes_on(kind, caplog):
    if kind == "function score":
        fn = _Hangs(1.0)
        provider, call, subject = FunctionScore(fn, timeout=0.2), "score", "reward function"
    elif kind == "verifier score":
        task = _HangingTask()
        fn, provider, call, subject = task.fn, VerifierScore(task, timeout=0.2), "score", "verifier"
    else:
        fn = _Hangs("think again")
        provider, call, subject = FunctionHint(fn, timeout=0.2), "hints", "hint function"
    try:
        with caplog.at_level("WARNING"):
            out = getattr(provider, call)([{}] * 3, ["a", "hang", "b"])
    finally:
        fn.release.set()
    expected = {"score": 1.0, "hints": "think again"}[call]
    assert out == [expected, None, expected]
    assert provider.failures == 1
    consequence = "it gets no hint" if call == "hints" else "it gets no score"
    assert _messages(caplog) == [
        f"{subject} timed out on sample 1 after 0.2 s ({consequence}; the call runs on in the "
        "background)"
    ]


def test_a_hint_function_returns_a_string_or_none_and_a_raising_one_is_counted(caplog):
    def hint(problem, completion):
        return {"ok": "check the carry", "none": None, "int": 3}.get(completion) or {}["x"]

    provider = FunctionHint(hint, timeout=None)  # None: in the caller's thread
    with caplog.at_level("WARNING"):
        out = provider.hints([{}] * 3, ["ok", "int", "raise"])
    assert out == ["check the carry", None, None] and provider.failures == 2
    assert _messages(caplog) == [
        "hint function returned int 3 on sample 1, expected a string, a list of strings or None (it gets no hint)",
        "hint function raised on sample 2 (it gets no hint): KeyError: 'x'",
    ]


@pytest.mark.parametrize("timeout", [0, -1.0, "60", True])
def test_a_timeout_is_positive_seconds_or_none(timeout):
    with pytest.raises(
        ValueError, match=rf"FunctionScore: timeout must be > 0 seconds or None, got {timeout!r}"
    ):
        FunctionScore(lambda p, c: 1.0, timeout=timeout)

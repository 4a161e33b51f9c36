"""One line as it happens when a run falls off a cliff: held-out accuracy, reply length,
truncation, tool calls.

A policy that collapses does not crash: on SmolLM2 a hint signal took held-out accuracy from
0.22 to 0.00 in 20 steps while mean replies shrank from 25 to 14 tokens, and the tiny tool
policy drifted to truncated non-answers (truncation 0.04 → 0.97); the loss looked fine
throughout. `CollapseWatch` compares each step with how the run started and says, once per
fall, what fell, from what, to what, and since when:

- held-out accuracy (`val/accuracy`) below half of its best so far, and at least
  `accuracy_drop` below it;
- the mean response length over the last `window` steps below `length_ratio` × that of the first
  `window` steps;
- the truncation rate over the last `window` steps above `max_truncation` when it started below;
- in tool episodes, the share of episodes that never called a tool (`episode/no_call_rate`: no
  turn got a next state) over the last `window` steps above `max_no_call` when it started
  below (the tool policy drifted to non-calls before its replies ran out of tokens).

A condition that clears and comes back is said again. `stop=True` also stops the run there
(a checkpoint follows as at any stop). Each line also goes to `collapse.jsonl` in the run
directory, which the run report marks on its curves. The module adds one with the defaults
unless the trainer has one of its own.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import lightning as L

from composer_lightning.runtime.distributed import world
from composer_lightning.runtime.rundir import append_rows

log = logging.getLogger(__name__)

#: What each step is watched for: its name here -> the step metric.
_WATCHED = {
    "length": "rollout/response_length_mean",
    "truncation": "rollout/truncation_rate",
    "no_call": "episode/no_call_rate",
}


class CollapseWatch(L.Callback):
    """Say (and optionally stop) when held-out accuracy, reply length or truncation collapse.

    Args:
        accuracy_drop: a held-out accuracy below half of the run's best and at least this far
            below it is a collapse (the margin keeps a noisy low accuracy from crying wolf:
            on SmolLM2 the shipped combine went 0.109 -> 0.031, Dr. GRPO alone 0.359 -> 0.578).
        length_ratio: a mean response length over the last `window` steps below this fraction
            of the first `window` steps' is a collapse.
        max_truncation: a truncation rate over the last `window` steps above this, in a run
            that started below it, is a collapse.
        max_no_call: the same for the share of tool episodes without a tool call.
        window: steps per mean.
        stop: stop the run when a collapse is seen.
    """

    def __init__(
        self,
        accuracy_drop: float = 0.05,
        length_ratio: float = 0.5,
        max_truncation: float = 0.5,
        window: int = 5,
        max_no_call: float = 0.5,
        stop: bool = False,
    ):
        if not 0 < accuracy_drop <= 1:
            raise ValueError(f"accuracy_drop must be in (0, 1], got {accuracy_drop}")
        if not 0 < length_ratio < 1:
            raise ValueError(f"length_ratio must be in (0, 1), got {length_ratio}")
        if not 0 < max_truncation < 1:
            raise ValueError(f"max_truncation must be in (0, 1), got {max_truncation}")
        if not 0 < max_no_call < 1:
            raise ValueError(f"max_no_call must be in (0, 1), got {max_no_call}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.accuracy_drop, self.length_ratio = accuracy_drop, length_ratio
        self.max_truncation, self.window, self.stop = max_truncation, window, stop
        self.max_no_call = max_no_call
        self.best: tuple[float, int] | None = None  # (accuracy, step)
        self.first: dict[str, float] = {}  # the first window's means
        self._early: dict[str, list[float]] = {k: [] for k in _WATCHED}
        self._recent: dict[str, deque[float]] = {k: deque(maxlen=window) for k in _WATCHED}
        self._said: set[str] = set()
        self.lines: list[str] = []  # what was said, for the caller (and tests)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "first": dict(self.first)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
        self.first = dict(state_dict.get("first") or {})

    def observe_step(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Take one training step's metrics; return the lines of collapses seen now."""
        found = []
        for key, metric in _WATCHED.items():
            if metric not in metrics:
                continue
            value = float(metrics[metric])
            self._recent[key].append(value)
            if key not in self.first:
                self._early[key].append(value)
                if len(self._early[key]) == self.window:
                    self.first[key] = sum(self._early[key]) / self.window
                continue
            if len(self._recent[key]) < self.window:
                continue
            now, then = sum(self._recent[key]) / self.window, self.first[key]
            since = f"steps {step - self.window + 1}–{step}"
            if key == "length":
                fell = now < self.length_ratio * then
                line = (
                    f"mean response length fell from {then:.1f} tokens (first {self.window} "
                    f"steps) to {now:.1f} ({since})"
                )
            elif key == "truncation":
                fell = then <= self.max_truncation < now
                line = (
                    f"truncation rate rose from {then:.2f} (first {self.window} steps) to "
                    f"{now:.2f} ({since}): replies run out of tokens"
                )
            else:
                fell = then <= self.max_no_call < now
                line = (
                    f"share of episodes without a tool call rose from {then:.2f} (first "
                    f"{self.window} steps) to {now:.2f} ({since}): the policy stopped calling tools"
                )
            found += self._say(key, fell, line)
        return found

    def observe_validation(self, step: int, accuracy: float) -> list[str]:
        """Take one held-out accuracy; return the line of a collapse seen now."""
        if self.best is None or accuracy > self.best[0]:
            self.best = (accuracy, step)
            return self._say("accuracy", False, "")
        best, at = self.best
        fell = accuracy <= best - self.accuracy_drop and accuracy < best / 2
        line = f"held-out accuracy fell from {best:.3f} (step {at}) to {accuracy:.3f} (step {step})"
        return self._say("accuracy", fell, line)

    def _say(self, key: str, fell: bool, line: str) -> list[str]:
        if not fell:
            self._said.discard(key)  # cleared: a later fall is said again
            return []
        if key in self._said:
            return []
        self._said.add(key)
        return [f"composer_lightning: collapse: {line}"]

    def _report(self, trainer: L.Trainer, lines: list[str]) -> None:
        if not lines:
            return
        self.lines += lines
        # for the run report's curves: at the step the metrics that fell are logged at
        at = {"step": max(trainer.global_step - 1, 0)}
        append_rows(trainer, "collapse.jsonl", [at | {"line": line} for line in lines])
        if world()[0] == 0:
            for line in lines:
                log.warning(
                    "%s%s", line, "; stopping (CollapseWatch(stop=True))" if self.stop else ""
                )
        if self.stop:
            trainer.should_stop = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        metrics = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")
        }
        self._report(trainer, self.observe_step(trainer.global_step, metrics))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val/accuracy" not in trainer.callback_metrics:
            return
        accuracy = float(trainer.callback_metrics["val/accuracy"])
        self._report(trainer, self.observe_validation(trainer.global_step, accuracy))

"""The teacher guard: the teacher heads go off for the rest of a run once the student's own
greedy accuracy has fallen, beyond noise, while they acted.

The hint check (`hint_check.py`) trusts a group's teacher where the hinted teacher's greedy
reply scores higher than the student's. A hint that states the right reply (a worked reply, "A
right reply: 23 + 48 = 71.") passes that check by being copied, and the hinted policy then
answers as if a user had already solved the sum ("Awesome! You're right, …"): SDPO, which
distils the teacher's distribution token by token, taught SmolLM2 that tone and its held-out
accuracy fell from 0.234 to 0.000 at step 10 where Dr. GRPO alone reached 0.625
(docs/benchmarks/composition.md). The check sees whether the teacher ends right, not whether
what it prefers is about the answer; what it prefers shows in the student. So the check's own
figure — the student's greedy accuracy on the batch's problems, measured every step for free —
is compared with the student's accuracy before the first update:

- the baseline is the step-0 check pooled with the held-out set's greedy accuracy at step 0
  (with `rollout.val_before_train`; without it, the step-0 check alone, 8 problems at 8
  prompts a step, so the test is weaker, not looser);
- after each step t ≥ `window`, the window is the checks of steps t − window + 1 … t; the
  teacher's share is the share of samples that had a teacher over steps t − window … t − 1
  (the updates the window's accuracy follows);
- the teacher goes off from step t + 1 when that share is at least `min_share` and the window's
  accuracy is below the baseline by more than `z` standard errors (a one-sided pooled
  two-proportion test). The run goes on as RL alone; a line says so, and `hint/teacher_off`
  logs it.

The teacher's samples are the rows with a teacher signal (OPD, top-k OPD, SDPO) and the replies
the hinted teacher wrote for context distillation (`hinted/replies`); once it is off, neither
is made (told a worked reply, the hinted SmolLM2 writes "…you indeed get 55.", which passes the
verifier, so context distillation imitates the tone as SDPO distils it).

Replayed on the logged runs of the fresh SmolLM2 task and of Gemma 3 (window 4, z 2, share
0.1), it stops the worked-reply SDPO run at step 8 and none of the nine healthy runs (their
largest z 2.3, in a Gemma run where the teacher had 4 % of the samples). A false stop costs the
teacher's gain, never more: the run is then RL alone. Scores outside [0, 1] (a reward of
another scale) are not a proportion; the guard then never stops the teacher.

Every figure it reads is reduced over ranks, so every rank decides the same; its state (the
baseline, the last steps, the step it stopped at) is in the rollout callback's checkpoint
state, so a resumed run decides as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepFigures:
    """One step's check, reduced over ranks: the student's summed score and the problems
    checked; the samples with a teacher and all samples."""

    score: float
    checked: float
    teacher_rows: float
    rows: float

    @classmethod
    def of(cls, reduced: Mapping[str, float]) -> StepFigures | None:
        """From the step's reduced `hint/...` and `dispatch/...` metrics; None without a check."""
        checked = float(reduced.get("hint/checked", 0.0))
        if checked <= 0:
            return None
        # the teacher's samples: rows with a teacher signal, and the replies the hinted
        # teacher wrote for context distillation to imitate
        teacher = sum(
            float(reduced.get(k, 0.0))
            for k in ("dispatch/opd_rl", "dispatch/opd_only", "hinted/replies")
        )
        return cls(
            score=float(reduced["hint/student_accuracy"]) * checked,
            checked=checked,
            teacher_rows=teacher,
            rows=teacher + float(reduced.get("dispatch/rl_only", 0.0)),
        )


def drop_z(base: tuple[float, float], window: tuple[float, float]) -> float | None:
    """How many standard errors the window's accuracy lies below the baseline's (a pooled
    two-proportion z; negative: above). Each is `(summed score, count)`; None where either
    count is 0, a mean lies outside [0, 1], or the pooled variance is 0."""
    (b, nb), (k, m) = base, window
    if nb <= 0 or m <= 0:
        return None
    p0, p = b / nb, k / m
    if not (0.0 <= p0 <= 1.0 and 0.0 <= p <= 1.0):
        return None
    pool = (b + k) / (nb + m)
    var = pool * (1.0 - pool) * (1.0 / nb + 1.0 / m)
    if var <= 0:
        return None
    return (p0 - p) / math.sqrt(var)


@dataclass
class TeacherGuard:
    """Turns the teacher heads off once the student's accuracy falls while they act (see the
    module's docstring).

    Attributes:
        window: steps of checks compared with the baseline.
        z: standard errors below the baseline that stop the teacher.
        min_share: the teacher's share of the samples, over the steps before the window's
            checks, below which a fall is not put down to it.
    """

    window: int = 4
    z: float = 2.0
    min_share: float = 0.1
    base: tuple[float, float] | None = None
    base_step: int = 0
    steps: list[tuple[int, StepFigures]] = field(default_factory=list)
    off_from: int | None = None

    @property
    def off(self) -> bool:
        return self.off_from is not None

    def observe(
        self, step: int, reduced: Mapping[str, float], heldout: tuple[float, float] = (0.0, 0.0)
    ) -> str | None:
        """Take step `step`'s reduced figures (the first step seen, with the held-out set's
        `(solved, prompts)` at that step, is the baseline); returns the line to say when the
        teacher goes off now, else None."""
        figures = StepFigures.of(reduced)
        if figures is None or self.off:
            return None
        if self.base is None:
            self.base = (figures.score + heldout[0], figures.checked + heldout[1])
            self.base_step = step
        self.steps = [(s, f) for s, f in self.steps if s > step - self.window - 1]
        self.steps.append((step, figures))
        z, acc, share = self.verdict(step)
        if z is None or z <= self.z or share < self.min_share:
            return None
        self.off_from = step + 1
        assert self.base is not None
        first = step - self.window + 1
        return (
            f"teacher guard: the teacher heads are off from step {step + 1}: the student's "
            f"greedy accuracy on the checked problems of steps {first}-{step} is {acc:.3f}, "
            f"{z:.1f} standard errors below its {self.base[0] / self.base[1]:.3f} before the "
            f"first update ({self.base[1]:.0f} problems), while the teacher had "
            f"{share:.0%} of the samples; the run goes on as RL alone "
            "(rollout.teacher_guard: false keeps the teacher on)"
        )

    def verdict(self, step: int) -> tuple[float | None, float, float]:
        """At `step`: the window's drop z (None: no full window yet), its accuracy and the
        teacher's share of the samples over the steps before it."""
        after = [f for s, f in self.steps if max(step - self.window, self.base_step) < s <= step]
        before = [f for s, f in self.steps if step - self.window <= s < step]
        rows = sum(f.rows for f in before)
        share = sum(f.teacher_rows for f in before) / rows if rows else 0.0
        k, m = sum(f.score for f in after), sum(f.checked for f in after)
        acc = k / m if m else 0.0
        if self.base is None or len(after) < self.window:
            return None, acc, share
        return drop_z(self.base, (k, m)), acc, share

    def state_dict(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "base_step": self.base_step,
            "steps": [(s, vars(f).copy()) for s, f in self.steps],
            "off_from": self.off_from,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        base = state.get("base")
        self.base = None if base is None else (float(base[0]), float(base[1]))
        self.base_step = int(state.get("base_step", 0))
        self.steps = [(int(s), StepFigures(**f)) for s, f in state.get("steps", [])]
        off = state.get("off_from")
        self.off_from = None if off is None else int(off)

"""Next-state judges that read explicit feedback, without a judge model.

When the next state is a user's reply that says plainly whether the turn was right and how to
fix it ("No, that is wrong. Hint: the answer has 2 digits."), these read it directly: an
evaluative signal (`FeedbackScore`: ±1) and a directive one (`FeedbackHint`: the correction).
They see a turn as every per-turn provider does (`rollout/turns.py`, `turn_problem`: `next_state`, the
messages that followed the turn) and give nothing for a turn without one. For feedback that
is not this explicit, use the LLM judges (`NextStateJudgeScore`, `NextStateJudgeHint`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from composer_lightning.tasks.base import HintProvider, Problem, ScoreProvider


def _reply(problem: Problem) -> str:
    """The text of the first user or tool message that followed the turn ('' if none)."""
    for m in problem.get("next_state") or []:
        if m.get("role") in ("user", "tool"):
            content = m.get("content")
            return content if isinstance(content, str) else ""
    return ""


class FeedbackScore(ScoreProvider):
    """`good` (+1.0) when the reply opens with a positive word, `bad` (−1.0) with a negative
    one, else None.

    Args:
        positive, negative: the words (case-insensitive, whole words at the reply's start).
            "Thanks" is not a verdict: people thank a wrong answer too.
        good, bad: the scores they give (OpenClaw-RL's +1 / −1 by default).
    """

    def __init__(
        self,
        positive: Sequence[str] = ("yes", "correct", "right", "great"),
        negative: Sequence[str] = ("no", "wrong", "incorrect", "not quite"),
        good: float = 1.0,
        bad: float = -1.0,
    ) -> None:
        self.good, self.bad = float(good), float(bad)
        self._pos = re.compile(rf"^\s*({'|'.join(map(re.escape, positive))})\b", re.IGNORECASE)
        self._neg = re.compile(rf"^\s*({'|'.join(map(re.escape, negative))})\b", re.IGNORECASE)

    def score(self, problems: list[Problem], completions: list[str]) -> list[float | None]:
        out: list[float | None] = []
        for p in problems:
            reply = _reply(p)
            out.append(
                self.bad
                if self._neg.match(reply)
                else self.good
                if self._pos.match(reply)
                else None
            )
        return out


class FeedbackHint(HintProvider):
    """The text after `marker` in the reply, to the end of its line (what follows on other
    lines is the user's next request, not the correction), as the turn's hint; None without it.

    Args:
        marker: what introduces the correction (case-insensitive).
    """

    def __init__(self, marker: str = "Hint:") -> None:
        if not marker:
            raise ValueError("FeedbackHint needs a non-empty marker")
        self._marker = re.compile(re.escape(marker) + r"[ \t]*([^\n]*)", re.IGNORECASE)

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        out: list[str | None] = []
        for p in problems:
            m = self._marker.search(_reply(p))
            out.append(m.group(1).strip() or None if m else None)
        return out

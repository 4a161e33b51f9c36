"""The rows of `rollouts.jsonl` (and TensorBoard's TEXT tab) a rollout batch writes: one per
problem, its first live episode, as a user reads it (`callbacks/samples.py` writes them).

Beside `sample_row`'s fields, `dispatch.build_rollout` gives each row `signal`, each turn's path
through the four-way dispatch (`signal_of`), and where the hint check ran on the row's group,
`teacher_hint`, `teacher_reply` and `teacher_reward`: the hint it checked, the hinted
teacher's greedy reply to it and that reply's score (`hint_check.py`).
"""

from __future__ import annotations

from typing import Any

from composer_lightning.rollout.episodes import Episode
from composer_lightning.runtime.calls import hint_candidates

#: Each sample's path by (usable score, accepted hint), named as the `dispatch/...` counts.
SIGNALS = {
    (True, True): "opd_rl",
    (False, True): "opd_only",
    (True, False): "rl_only",
    (False, False): "dropped",
}


def signal_of(reward: float | None, hint: Any) -> str:
    """A turn's path through the dispatch, from its reward (None: no usable score) and the hint
    its teacher context was made from (None: no accepted, trusted hint)."""
    return SIGNALS[(reward is not None, hint is not None)]


def first_of_groups(live: list[tuple[int, Episode]]) -> list[tuple[int, Episode]]:
    """The first live episode of each problem, with its index among the live ones."""
    seen, out = set(), []
    for n, (i, ep) in enumerate(live):
        if i not in seen:
            seen.add(i)
            out.append((n, ep))
    return out


def sample_row(
    ep: Episode, reward: float | None, turns: list[tuple[float | None, Any]]
) -> dict[str, Any]:
    """One sample row of `rollouts.jsonl`: a single turn as (prompt, completion, reward, hint);
    an episode as its chat, each assistant turn with its reward and hint (`turns`), and the
    tool specs the model was shown."""
    if len(ep.turns) == 1 and not ep.tools and not ep.turns[0].has_next_state:
        h = turns[0][1]
        return {
            "prompt": (ep.turns[0].context or [{"content": ""}])[-1]["content"],
            "completion": ep.turns[0].text,
            "reward": reward,
            "hint": next(iter(hint_candidates(h)), None),
        } | ({"hint_candidates": h} if len(hint_candidates(h)) > 1 else {})
    messages, t = [], 0
    for m in ep.messages:
        m = {"role": m["role"], "content": m["content"]}
        if m["role"] == "assistant" and t < len(turns):
            value, h = turns[t]
            m |= {"reward": value, "hint": next(iter(hint_candidates(h)), None)}
            t += 1
        messages.append(m)
    tools = {"tools": ep.tools} if ep.tools else {}
    return {"messages": messages, "reward": reward, "status": ep.status} | tools

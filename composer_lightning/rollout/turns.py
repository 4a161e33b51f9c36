"""The turns of a rollout batch as the dispatch walks them (`dispatch.build_rollout`).

Every assistant turn of every live episode becomes one `TurnRef`: which episode (its index
among the live ones, for the rewards), which problem (its index in the prompt batch, for the
group ids), and which turn. What the providers see of a turn (`turn_problem`) and the tokenised
sample a turn becomes (`rollout_sample`) are defined here beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_lightning.chat import TraceSample, single_turn_teacher
from composer_lightning.engines.base import Completion
from composer_lightning.rollout.episodes import Episode, Turn
from composer_lightning.runtime.calls import hint_candidates


@dataclass(frozen=True)
class TurnRef:
    """One assistant turn of a live episode.

    Attributes:
        live: the episode's index among the batch's live (not failed) episodes.
        problem: the index of its problem in the prompt batch (its group, within the batch).
        episode: the episode.
        index: the turn's index in the episode.
    """

    live: int
    problem: int
    episode: Episode
    index: int

    @property
    def turn(self) -> Turn:
        return self.episode.turns[self.index]

    @property
    def last(self) -> bool:
        """The episode's last turn (it keeps the episode's outcome)."""
        return self.index == len(self.episode.turns) - 1

    @property
    def final(self) -> bool:
        """The last turn, with no next state: scored and hinted like a single-turn reply."""
        return self.last and not self.turn.has_next_state

    @property
    def pair(self) -> tuple[Episode, int]:
        """`(episode, turn index)`, as the hinted replies and the hint check take a turn."""
        return self.episode, self.index

    def provider_problem(self) -> dict[str, Any]:
        """What a score or hint provider sees as the turn's problem: the episode's problem for
        the final turn, else `turn_problem`."""
        if self.final:
            return self.episode.problem
        return turn_problem(self.episode.problem, self.turn, self.index)

    def engine_logprobs(self) -> list[float]:
        """The engine's log-probs of the turn on the sample's whole row (0 on the context)."""
        return [0.0] * len(self.turn.context_ids) + list(self.turn.completion.logprobs)


def live_turns(live: list[tuple[int, Episode]]) -> list[TurnRef]:
    """Every turn of the live episodes (`(problem index, episode)`), in order."""
    return [TurnRef(e, i, ep, t) for e, (i, ep) in enumerate(live) for t in range(len(ep.turns))]


def turn_problem(problem: dict[str, Any], turn: Turn, index: int) -> dict[str, Any]:
    """What a score or hint provider sees of an episode's turn `index` that has a next state:
    the problem's fields, with `messages` = the turn's context (the chat before it), plus
    `next_state` (the messages that followed the turn), `tool_error` (the tool's error of the
    turn, or None) and `turn` (its index). The completion passed beside it is the turn's text."""
    obs = turn.next_state
    return {
        **problem,
        "messages": turn.context,
        "next_state": list(obs.messages) if obs is not None else [],
        "tool_error": obs.tool_error if obs is not None else None,
        "turn": index,
    }


def rollout_sample(
    tokenizer: Any,
    context: list[dict[str, Any]],
    prompt: list[int],
    c: Completion,
    hint: str | list[str] | None,
    hint_role: str,
    tools: list[dict[str, Any]] | None = None,
) -> TraceSample:
    """One assistant turn as a tokenised sample: `prompt` (the ids before it: a single-turn
    prompt, or turn t's whole context) ⊕ the turn's ids, the turn's tokens carrying loss, and
    the hinted teacher context (`context` with the hint spliced right before the turn): the
    (first) hint's, and with a hint every candidate's, shortest hint first."""
    ids = list(prompt) + list(c.token_ids)
    response = [False] * len(prompt) + [True] * len(c.token_ids)
    hints = hint_candidates(hint)
    if not hints:
        return TraceSample(ids, response, None, [-1] * len(ids), [False] * len(ids), None)
    contexts = {
        h: single_turn_teacher(tokenizer, context, c.token_ids, h, hint_role, tools) for h in hints
    }
    by_length = sorted(hints, key=lambda h: len(contexts[h].teacher_ids))  # stable: ties in order
    teacher = contexts[hints[0]]
    return TraceSample(
        ids,
        response,
        teacher.teacher_ids,
        teacher.positions(len(prompt), len(ids)),
        response,
        None,
        [
            (contexts[h].teacher_ids, contexts[h].positions(len(prompt), len(ids)))
            for h in by_length
        ],
    )


def turn_sample(ref: TurnRef, tokenizer: Any, hint: Any, hint_role: str) -> TraceSample:
    """`rollout_sample` of a turn with its teacher hint (None: no teacher context)."""
    turn = ref.turn
    return rollout_sample(
        tokenizer,
        turn.context,
        turn.context_ids,
        turn.completion,
        hint,
        hint_role,
        ref.episode.tools,
    )

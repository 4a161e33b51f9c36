"""Replies sampled with the hint in context: what context distillation imitates.

OPD and SDPO score the student's own tokens under the hinted teacher, so they can only pass on
what the teacher thinks of a reply the student already wrote. Where the hint would change the
reply itself (a format the student never writes, a tool call it skips), the signal is not in
those tokens. Context distillation (Snell et al. 2022, "Learning by Distilling Context",
https://arxiv.org/abs/2209.15189) samples the reply from the hinted context instead and
trains the student, *without* the hint, on it: `ContextDistillHead` (heads/context_distill.py)
is the negative log-likelihood of these replies under the student's own context, optionally
only of those the verifier accepts (rejection sampling).

With `rollout.hinted_replies`, the first `per_group` hinted turns of each group (in batch
order) get one reply each, sampled by the rollout's engine with the same weights, from the
turn's hinted teacher context (`chat.single_turn_teacher`: the hint placed as `hint_role`
says). A reply that ends its episode (a single-turn reply) is scored by the score provider as
the student's would be; a turn with a next state (a tool call) has no outcome of its own and
stays unscored. A reply cut by `max_tokens` is dropped (counted), never imitated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import attrgetter, itemgetter
from typing import Any, Literal, TypeVar, cast

import torch

from composer_lightning.chat import single_turn_teacher
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.protocols.batch import RolloutBatch, pad_rows
from composer_lightning.rollout.providers import (
    provider_components,
    provider_logs,
    provider_values,
)
from composer_lightning.runtime.calls import hint_candidates
from composer_lightning.runtime.distributed import StepMetrics
from composer_lightning.tasks.base import ScoreProvider

T = TypeVar("T")


@dataclass
class HintedReplies:
    """`rollout.hinted_replies`: sample a reply from the hinted context of some turns.

    Attributes:
        per_group: the hinted turns of each group that get a reply of their own (the first
            ones, in batch order), ≥ 1.
        temperature: the sampling temperature of these replies; 0 decodes greedily (the
            hinted teacher's most likely reply); None: the rollout's own temperature. The
            replies are imitated, not weighted by their sampling probability, so any
            temperature is sound.
        source: "sampled" (default): the hinted teacher writes each reply; "hint": the reply
            IS the hint's text (ended by EOS), nothing sampled, scored as a reply is: where a
            hint states a right reply ("A right reply: 40 + 13 = 53, so ANSWER: 53"),
            `context_distill` on it is supervised training on that reference text, the
            baseline context distillation has to beat.
    """

    per_group: int = 1
    temperature: float | None = None
    source: Literal["sampled", "hint"] = "sampled"

    def __post_init__(self) -> None:
        if (
            isinstance(self.per_group, bool)
            or not isinstance(self.per_group, int)
            or self.per_group < 1
        ):
            raise ValueError(
                f"hinted_replies.per_group must be an integer >= 1, got {self.per_group!r}"
            )
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not math.isfinite(t) or t < 0):
            raise ValueError(
                f"hinted_replies.temperature must be >= 0 (0: greedy) or None (the "
                f"rollout's), got {t!r}"
            )
        if self.source not in ("sampled", "hint"):
            raise ValueError(
                f"hinted_replies.source must be 'sampled' or 'hint', got {self.source!r}"
            )


@dataclass
class HintedTurn:
    """A turn whose hint gets a reply of its own.

    Attributes:
        group: the group id of the turn's row.
        student_ids: the turn's context as the student saw it (the ids before its reply).
        teacher_prompt: the same context with the hint placed, ending in the generation
            prompt.
        problem: what the score provider scores a reply with; None: unscored (a turn with a
            next state, or an episode whose outcome is the environment's).
        hint: the hint placed in `teacher_prompt`.
    """

    group: int
    student_ids: list[int]
    teacher_prompt: list[int]
    problem: dict[str, Any] | None
    hint: str = ""


def episode_turn(
    tokenizer: Any, group: int, episode: Any, t: int, hint: str, hint_role: str
) -> HintedTurn:
    """The `HintedTurn` of turn `t` of `episode` (an `episodes.Episode`) with `hint`: its
    context, hinted as `hint_role` says; scored by the score provider when it ends an episode
    whose outcome the provider gives (not the environment)."""
    turn = episode.turns[t]
    final = t == len(episode.turns) - 1 and not turn.has_next_state
    teacher = single_turn_teacher(tokenizer, turn.context, [], hint, hint_role, episode.tools)
    problem = episode.problem if final and episode.reward is None else None
    return HintedTurn(group, list(turn.context_ids), teacher.teacher_ids, problem, hint)


def first_per_group(
    items: list[T], per_group: int, group: Callable[[T], int] = attrgetter("group")
) -> list[T]:
    """The first `per_group` items of each group (`group(item)`), in their order."""
    seen: dict[int, int] = {}
    out = []
    for item in items:
        g = group(item)
        if seen.get(g, 0) < per_group:
            seen[g] = seen.get(g, 0) + 1
            out.append(item)
    return out


def sample_hinted(
    turns: list[HintedTurn],
    generate: Callable[[list[list[int]], int, SamplingConfig], list[list[Completion]]],
    sampling: SamplingConfig,
    settings: HintedReplies,
    score: ScoreProvider,
    tokenizer: Any,
    collective: bool = False,
) -> tuple[RolloutBatch, StepMetrics, list[str]]:
    """One reply per turn from its hinted context, scored where it can be, as a `RolloutBatch` of
    their own (`RolloutBatch.hinted`).

    Args:
        generate: the rollout's `(prompts, n, sampling) -> completions` (seeded by
            `sampling.seed`).
        sampling: the rollout's sampling settings, the seed of this call included; the
            temperature is `settings.temperature` where that is set.
        collective: call `generate` even without turns (a tensor-parallel engine's ranks
            generate together).

    Returns:
        The rows (none, when no turn was hinted or every reply was cut), the step's
        `hinted/...` metrics, and each row's reply as text.
    """
    if settings.temperature is not None:
        sampling = replace(sampling, temperature=settings.temperature)
    prompts = [t.teacher_prompt for t in turns]
    start = time.perf_counter()
    if settings.source == "hint":  # the hint's own text is the reply: nothing sampled
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        outs = [
            [
                Completion(
                    tokenizer.encode(t.hint, add_special_tokens=False) + eos, [], "stop", t.hint
                )
            ]
            for t in turns
        ]
    else:
        outs = generate(prompts, 1, sampling) if prompts or collective else []
    gen_time = time.perf_counter() - start
    replies = [group[0] for group in outs]
    kept = [k for k, c in enumerate(replies) if c.finish_reason != "length"]
    scored = [k for k in kept if turns[k].problem is not None]
    text = {
        k: c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
        for k, c in ((k, replies[k]) for k in kept)
    }
    values, failures = (
        provider_values(
            score,
            "score",
            [cast(dict[str, Any], turns[k].problem) for k in scored],  # scored: not None
            [text[k] for k in scored],
            [list(replies[k].token_ids) for k in scored],
        )
        if scored
        else ([], 0)
    )
    # what the provider keeps of its last call (per-function values, logged metrics) is the
    # student's batch's, not these replies': drop these replies' from it
    provider_components(score)
    provider_logs(score)
    reward = dict(zip(scored, values, strict=True))
    seqs = [turns[k].student_ids + list(replies[k].token_ids) for k in kept]
    response = [
        [False] * len(turns[k].student_ids) + [True] * len(replies[k].token_ids) for k in kept
    ]
    rewards = [reward.get(k) for k in kept]
    rows = RolloutBatch(
        input_ids=pad_rows(seqs, value=tokenizer.pad_token_id or 0),
        attention_mask=pad_rows([[1] * len(s) for s in seqs]),
        response_mask=pad_rows(response, dtype=torch.bool),
        rewards=torch.tensor([0.0 if r is None else r for r in rewards], dtype=torch.float),
        has_reward=torch.tensor([r is not None for r in rewards], dtype=torch.bool),
        group_ids=torch.tensor([turns[k].group for k in kept], dtype=torch.long),
        max_response_length=sampling.max_tokens,
    )
    metrics = StepMetrics()
    metrics.sum("hinted/replies", float(len(kept)))
    metrics.sum("hinted/truncated", float(len(replies) - len(kept)))
    metrics.max("hinted/gen_time", gen_time)
    metrics.sum("hinted/score_failures", float(failures))
    got = [r for r in rewards if r is not None]
    metrics.sum("hinted/scored", float(len(got)))  # the reward mean is over these
    metrics.mean("hinted/reward_mean", sum(got) / max(len(got), 1), weight=float(len(got)))
    lengths = [len(replies[k].token_ids) for k in kept]
    metrics.mean(
        "hinted/response_length_mean",
        sum(lengths) / max(len(lengths), 1),
        weight=float(len(lengths)),
    )
    return rows, metrics, [text[k] for k in kept]


@dataclass
class HintedSampler:
    """How one rollout batch samples its hinted replies: the settings, the rollout's
    `generate` and its sampling settings with this batch's seed for them; `off`: the teacher
    guard stopped the teacher (`teacher_guard.py`), so no turn gets a hinted reply (the batch's
    `hinted` is empty, and a collective `generate` still runs)."""

    settings: HintedReplies
    generate: Callable[[list[list[int]], int, SamplingConfig], list[list[Completion]]]
    sampling: SamplingConfig
    collective: bool = False
    off: bool = False

    def from_turns(
        self,
        tokenizer: Any,
        turns: list[tuple[Any, int]],
        groups: list[int],
        hints: list[Any],
        hint_role: str,
        score: ScoreProvider,
    ) -> tuple[RolloutBatch, StepMetrics, list[str]]:
        """The hinted replies of a batch's turns (`(episode, t)`, each with its group id and
        its hint or hint candidates, None: no hint): the first hint of each of the first
        `per_group` hinted turns of each group (only those are rendered)."""
        hinted = [
            (group, episode, t, first[0])
            for (episode, t), group, first in zip(
                turns, groups, map(hint_candidates, hints), strict=True
            )
            if first and not self.off
        ]
        chosen = first_per_group(hinted, self.settings.per_group, group=itemgetter(0))
        return sample_hinted(
            [episode_turn(tokenizer, *turn, hint_role) for turn in chosen],
            self.generate,
            self.sampling,
            self.settings,
            score,
            tokenizer,
            self.collective,
        )

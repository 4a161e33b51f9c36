"""From sampled completions to a `RolloutBatch`: score, hint, the four-way dispatch, packing.

The dispatch is a pure decision per sample (docs/design.md, "The four-way dispatch"): a usable score gives `has_reward`, an
accepted hint `has_teacher`; a sample with neither is dropped. Counts of each path are logged
as `dispatch/...`.

Score and hint providers fail per sample (`providers.py`), counted in
`rollout/score_failures` / `rollout/hint_failures` with one summary line per step — never a
crashed batch (unless every score failed: `ScoringError`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.rollout.episodes import Episode
from composer_lightning.rollout.hint_check import (
    HintCheck,
    TeacherReplies,
    below_mean_rows,
    checked_hints,
    teacher_bars,
)
from composer_lightning.rollout.hinted import HintedSampler
from composer_lightning.rollout.packing import pack_samples
from composer_lightning.rollout.providers import provider_components, provider_logs, provider_values
from composer_lightning.rollout.rollout_metrics import Failures, episode_metrics, rollout_metrics
from composer_lightning.rollout.sample_rows import first_of_groups, sample_row, signal_of
from composer_lightning.rollout.turns import TurnRef, live_turns, turn_sample
from composer_lightning.runtime.distributed import StepMetrics
from composer_lightning.tasks.base import HintProvider, ScoreProvider, ScoringError

log = logging.getLogger(__name__)


def dispatch(has_reward: list[bool], has_teacher: list[bool]) -> tuple[list[int], dict[str, float]]:
    """The samples kept (a score or a hint) and the count of each path: OPD+RL, OPD-only,
    RL-only, dropped."""
    both = list(zip(has_reward, has_teacher, strict=True))
    keep = [k for k, (r, t) in enumerate(both) if r or t]
    counts = {
        "dispatch/opd_rl": float(sum(r and t for r, t in both)),
        "dispatch/opd_only": float(sum(t and not r for r, t in both)),
        "dispatch/rl_only": float(sum(r and not t for r, t in both)),
        "dispatch/dropped": float(len(both) - len(keep)),
    }
    return keep, counts


@dataclass(frozen=True)
class RolloutPlan:
    """How a rollout batch is built from its episodes (the rollout callback's settings).

    Its defaults leave each filter off (no hint check, no placebo, the teacher on every hinted
    reply): the plain dispatch a direct caller composes. The library's defaults (the check, the
    teacher below the group's mean) are `RolloutCallback`'s, which fills every field.

    Attributes:
        tokenizer: the policy's tokenizer.
        max_tokens: the longest reply, in tokens (the packed batch's response width).
        score: the score provider (each episode's outcome, unless its environment gave one).
        hint: the hint provider (None: no hints).
        hint_role: where the hint goes in the teacher context (`chat.teacher`).
        hint_template: each hint's text as it is read, `{hint}` where it goes (`chat.fill_hint`).
        samples_per_step: sample rows returned, one per problem.
        mask_truncated: TRL's `mask_truncated_completions`: an episode that ran out of tokens
            keeps its reward in its group's statistics but has no token in any loss.
        turn_score: rewards each turn with a next state on its own (e.g.
            `NextStateJudgeScore`); None: every turn gets its episode's outcome.
        truncation_penalty: p > 0: an episode that ran out of tokens scores its score minus
            p (−p when it has none).
        teacher: a head reads a teacher (else the hints only seed hinted replies).
        hinted: samples hinted replies (`hinted.py`); None: none.
        check: trusts the teacher only where it knows better (`hint_check.py`); None: always.
        placebo_seed: gives every turn another problem's hint (`hint_check.placebo_hints`).
        teacher_replies: "below_mean": the teacher only on the replies below their group's
            mean reward (`hint_check.below_mean_rows`); "below_teacher": below the score of
            the hinted teacher's own reply where `check` scored one (`hint_check.teacher_bars`),
            else below the mean; "all": on every hinted reply.
    """

    tokenizer: Any
    max_tokens: int
    score: ScoreProvider
    hint: HintProvider | None = None
    hint_role: str = "user"
    hint_template: str = "{hint}"  # the hint itself
    samples_per_step: int = 0
    mask_truncated: bool = False
    turn_score: ScoreProvider | None = None
    truncation_penalty: float = 0.0
    teacher: bool = True
    hinted: HintedSampler | None = None
    check: HintCheck | None = None
    placebo_seed: int | None = None
    teacher_replies: TeacherReplies = "all"


@dataclass
class Outcomes:
    """Each live episode's outcome and what the score provider said beside it.

    Attributes:
        rewards: per live episode (None: no usable score).
        asked: the live episodes whose outcome the score provider gave (the others had their
            environment's), in the order of its calls.
        failures: the score provider's failed calls among them (their rewards are None).
        parts: each reward function's own values and weights (GDPO), or None.
        logged: the reward functions' metrics, `name -> (value, weight)`.
        extras: their per-episode columns, by live episode.
    """

    rewards: list[float | None]
    asked: list[int]
    failures: int
    parts: Any
    logged: dict[str, tuple[float, float]]
    extras: dict[int, dict[str, Any]]


def build_rollout(
    batch: PromptBatch, episodes: list[list[Episode]], plan: RolloutPlan
) -> tuple[RolloutBatch, StepMetrics, list[dict[str, Any]]]:
    """Score, hint, dispatch and pack the turns of one prompt batch's episodes.

    Which signal reaches which tokens (docs/design.md, "The agentic setting"):
    - The episode's outcome — the environment's reward, or else the score provider on the
      problem and the episode's final turn — is the reward of every turn of the episode, so
      the GRPO advantage of the episode (group baseline over the G episodes of its problem,
      `episode_ids`) reaches all its assistant tokens.
    - Each turn gets its own hint: a turn with a next state goes to the hint provider as
      (`turn_problem`: its context and next state, its text), the final turn as (problem, its
      text) like a single-turn completion. The teacher context of turn t is turn t's context
      with the hint spliced in, so OPD and SDPO act on turn t's tokens.
    - With `plan.turn_score` (e.g. `NextStateJudgeScore`, OpenClaw-RL's PRM on
      `(a_t, s_{t+1})`), a turn with a next state is rewarded by it instead, as a sample of its
      own in its group's baseline (its own `episode_ids` entry); the final turn keeps the
      outcome, also when it has a next state (an episode cut at `max_turns`), so an episode
      that only calls tools until `max_turns` never ties with one that solved the task.
    - The four-way dispatch is per turn: a turn with neither a reward nor a hint is dropped.
    A failed episode (an environment error) is dropped whole and counted.

    The hints make the rows' teacher contexts only with `plan.teacher` (a head reads a
    teacher); with `plan.hinted`, the first hinted turns of each group also get a reply sampled
    from their hinted context (`hinted.py`), as `RolloutBatch.hinted`. With
    `plan.placebo_seed` every hint is first replaced by another problem's
    (`hint_check.placebo_hints`); with `plan.check`, a teacher context is made only in the
    groups whose hinted teacher knows better (`hint_check.py`); with `plan.teacher_replies`
    "below_mean", only on their replies below the group's mean reward; "below_teacher", below
    the hinted teacher's own reply's score.

    Returns:
        The rollout batch; the step's rollout metrics, each with its reduction over ranks
        (counts summed, means weighted by their samples, maxima); and one row per prompt for
        the first `samples_per_step` prompts (a single turn: prompt, completion, reward, hint;
        an episode: its chat `messages`, each assistant turn with its reward and hint; with
        `hinted`, the group's first hinted reply and its score, `hinted_reply` and
        `hinted_reward`; and the fields `sample_rows.py` names: `signal`, `teacher_*`).

    Raises:
        ScoringError: every episode failed, every score call failed, or every turn was
            dropped.
    """
    flat = [(i, ep) for i, group in enumerate(episodes) for ep in group]
    live = [(i, ep) for i, ep in flat if ep.status != "failed"]
    failures = Failures(
        episodes=[ep for _, ep in flat if ep.status == "failed"], episode_count=len(flat)
    )
    if not live:
        raise ScoringError(
            f"every episode of rollout batch {batch.index} failed (their errors are logged "
            f"above; the first: {failures.episodes[0].error if failures.episodes else None})"
        )
    out = outcomes(plan.score, [ep for _, ep in live], plan.truncation_penalty)
    refs = live_turns(live)
    problems = [ref.provider_problem() for ref in refs]
    texts = [ref.turn.text for ref in refs]
    row_rewards, own, turn_failures, turn_logged = turn_rewards(
        plan.turn_score, refs, problems, texts, [out.rewards[ref.live] for ref in refs]
    )
    failures.score, failures.asked = out.failures + turn_failures, len(out.asked)
    hints, failures.hint = (
        provider_values(plan.hint, "hint", problems, texts)
        if plan.hint is not None
        else ([None] * len(refs), 0)
    )
    failures.turns = len(refs)
    groups = [batch.group_of(ref.problem) for ref in refs]
    pairs = [ref.pair for ref in refs]
    hints, row_hints, check_metrics = checked_hints(
        plan.check,
        plan.placebo_seed,
        plan.tokenizer,
        pairs,
        groups,
        hints,
        plan.hint_role,
        plan.score,
        plan.teacher,
        plan.hint_template,
    )
    if plan.teacher_replies != "all" and plan.teacher:
        judged = [own[k] or ref.last for k, ref in enumerate(refs)]  # Dr. GRPO's baseline
        bars = teacher_bars(plan.check) if plan.teacher_replies == "below_teacher" else None
        row_hints, below = below_mean_rows(row_hints, row_rewards, groups, judged, bars)
        check_metrics.include(below)
    keep, counts = dispatch(
        [r is not None for r in row_rewards], [h is not None for h in row_hints]
    )
    if not keep:
        raise _all_dropped(batch, plan, hints, row_hints)
    rollout = pack_samples(
        [turn_sample(refs[k], plan.tokenizer, row_hints[k], plan.hint_role) for k in keep],
        rewards=[row_rewards[k] for k in keep],
        group_ids=[groups[k] for k in keep],
        pad_id=plan.tokenizer.pad_token_id or 0,
        max_response_length=plan.max_tokens,
        engine_logprobs=[refs[k].engine_logprobs() for k in keep],
    )
    episode_index = {id(ep): n for n, (_, ep) in enumerate(flat)}
    rollout.episode_ids = torch.tensor(  # unique within the batch, where advantages are taken
        [len(flat) + k if own[k] else episode_index[id(refs[k].episode)] for k in keep]
    )
    if out.parts is not None:
        _reward_components(rollout, out, [(refs[k].live, own[k]) for k in keep])
    shown, hinted_metrics = _hinted_replies(rollout, plan, pairs, groups, hints)
    truncated = None
    if plan.mask_truncated:
        truncated = torch.tensor([refs[k].episode.status == "truncated" for k in keep])
        rollout.response_mask &= ~truncated[:, None]
        assert rollout.sdpo_mask is not None  # RolloutBatch.__post_init__ fills it
        rollout.sdpo_mask &= ~truncated[:, None]
    rows = _sample_rows(batch, plan, live, out, refs, row_rewards, hints, row_hints, shown)
    failures.warn(batch.index)
    metrics = rollout_metrics(
        [ep for _, ep in live],
        out.rewards,
        counts,
        truncated,
        failures,
        [plan.score, plan.hint],
        out.logged | turn_logged,
    )
    metrics.include(hinted_metrics)
    metrics.include(check_metrics)
    metrics.include(episode_metrics([ep for _, ep in flat]))
    return rollout, metrics, rows


def outcomes(score: ScoreProvider, live: list[Episode], truncation_penalty: float) -> Outcomes:
    """Each live episode's outcome: its environment's reward, else the score provider's on its
    problem and final turn; minus `truncation_penalty` for an episode that ran out of tokens."""
    asked = [k for k, ep in enumerate(live) if ep.reward is None]
    finals = [live[k].turns[-1] for k in asked]
    values, failures = provider_values(
        score,
        "score",
        [live[k].problem for k in asked],
        [t.text for t in finals],
        [list(t.completion.token_ids) for t in finals],
    )
    ScoringError.raise_if_all_failed(values, failures)
    logged, extra = provider_logs(score)  # its reward functions' metrics and columns
    extras = {
        asked[j]: {c: v[j] for c, v in extra.items() if j < len(v)} for j in range(len(asked))
    }
    rewards: list[float | None] = [ep.reward for ep in live]
    for k, value in zip(asked, values, strict=True):
        rewards[k] = value
    if truncation_penalty:
        for k, ep in enumerate(live):
            if ep.status == "truncated":
                rewards[k] = (rewards[k] or 0.0) - truncation_penalty
    parts = provider_components(score)  # each reward function's own values (GDPO)
    return Outcomes(rewards, asked, failures, parts, logged, extras)


def turn_rewards(
    turn_score: ScoreProvider | None,
    refs: list[TurnRef],
    problems: list[dict[str, Any]],
    texts: list[str],
    rewards: list[float | None],
) -> tuple[list[float | None], list[bool], int, dict[str, tuple[float, float]]]:
    """Each turn's reward: its episode's outcome (`rewards`), or with `turn_score` that
    provider's own score for every turn with a next state but the episode's last (that keeps
    the outcome: an episode cut at max_turns ends on a next state, too).

    Returns:
        The turns' rewards, whether each is a sample of its own (rewarded on its own), the
        failed `turn_score` calls and its metrics (as `turn_<name>`).
    """
    rewards, own = list(rewards), [False] * len(refs)
    if turn_score is None:
        return rewards, own, 0, {}
    scored = [k for k, ref in enumerate(refs) if ref.turn.has_next_state and not ref.last]
    values, failures = provider_values(
        turn_score,
        "score",
        [problems[k] for k in scored],
        [texts[k] for k in scored],
        [list(refs[k].turn.completion.token_ids) for k in scored],
    )
    for k, value in zip(scored, values, strict=True):
        rewards[k], own[k] = value, True
    logged, _ = provider_logs(turn_score)
    return rewards, own, failures, {f"turn_{name}": value for name, value in logged.items()}


def _all_dropped(
    batch: PromptBatch, plan: RolloutPlan, hints: list[Any], row_hints: list[Any]
) -> ScoringError:
    gated = any(hints) and not any(row_hints)
    return ScoringError(
        f"no sample of rollout batch {batch.index} has a usable score or an accepted "
        "hint: every sample was dropped"
        + (
            " (the hint check trusted no hint: rollout.hint_trust: always uses them unchecked)"
            if gated and plan.check is not None
            else ""
        )
    )


def _reward_components(rollout: RolloutBatch, out: Outcomes, rows: list[tuple[int, bool]]) -> None:
    """Each row's reward functions' own values (GDPO), by `(live episode, own)`: NaN for a turn
    rewarded on its own, or by its environment (no parts)."""
    values, weights = out.parts
    by_episode = dict(zip(out.asked, values, strict=True))
    nan = [math.nan] * len(weights)
    rollout.reward_components = torch.tensor(
        [
            nan
            if own or e not in by_episode
            else [math.nan if v is None else v for v in by_episode[e]]
            for e, own in rows
        ],
        dtype=torch.float64,
    )
    rollout.reward_weights = tuple(weights)


def _hinted_replies(
    rollout: RolloutBatch,
    plan: RolloutPlan,
    pairs: list[tuple[Episode, int]],
    groups: list[int],
    hints: list[Any],
) -> tuple[dict[int, dict[str, Any]], StepMetrics]:
    """With `plan.hinted`, the batch's hinted replies (set as `rollout.hinted`) and each
    group's first one, for its sample row."""
    shown: dict[int, dict[str, Any]] = {}
    if plan.hinted is None:
        return shown, StepMetrics()
    args = (plan.tokenizer, pairs, groups, hints, plan.hint_role, plan.score)
    rollout.hinted, metrics, texts = plan.hinted.from_turns(*args)
    for g, r, ok, text in zip(
        rollout.hinted.group_ids.tolist(),
        rollout.hinted.rewards.tolist(),
        rollout.hinted.has_reward.tolist(),
        texts,
        strict=True,
    ):
        shown.setdefault(g, {"hinted_reply": text, "hinted_reward": r if ok else None})
    return shown, metrics


def _sample_rows(
    batch: PromptBatch,
    plan: RolloutPlan,
    live: list[tuple[int, Episode]],
    out: Outcomes,
    refs: list[TurnRef],
    row_rewards: list[float | None],
    hints: list[Any],
    row_hints: list[Any],
    shown: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The first `plan.samples_per_step` problems' rows (`sample_rows.py`)."""
    by_turn = {(ref.live, ref.index): k for k, ref in enumerate(refs)}
    replies = plan.check.teacher_replies if plan.check is not None else {}
    rows = []
    for n, ep in first_of_groups(live)[: plan.samples_per_step]:
        ks = [by_turn[(n, t)] for t in range(len(ep.turns))]
        group = batch.group_of(live[n][0])
        rows.append(
            sample_row(ep, out.rewards[n], [(row_rewards[k], hints[k]) for k in ks])
            | ({"extra": out.extras[n]} if out.extras.get(n) else {})
            | shown.get(group, {})
            | replies.get(group, {})
            | {"signal": [signal_of(row_rewards[k], row_hints[k]) for k in ks]}
        )
    return rows

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
from typing import Any

import torch

from composer_lightning.chat import TraceSample, single_turn_teacher
from composer_lightning.engines.base import Completion
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.rollout.episodes import Episode, Turn
from composer_lightning.rollout.hint_check import HintCheck, checked_hints
from composer_lightning.rollout.hinted import HintedSampler
from composer_lightning.rollout.packing import pack_samples
from composer_lightning.rollout.providers import provider_components, provider_logs, provider_values
from composer_lightning.rollout.sample_rows import first_of_groups, sample_row, signal_of
from composer_lightning.runtime.calls import hint_candidates
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


def build_rollout(
    batch: dict[str, Any],
    episodes: list[list[Episode]],
    tokenizer: Any,
    max_tokens: int,
    score: ScoreProvider,
    hint: HintProvider | None,
    hint_role: str,
    group_size: int,
    samples_per_step: int,
    mask_truncated: bool = False,
    turn_score: ScoreProvider | None = None,
    truncation_penalty: float = 0.0,
    teacher: bool = True,
    hinted: HintedSampler | None = None,
    check: HintCheck | None = None,
    placebo_seed: int | None = None,
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
    - With `turn_score` (e.g. `NextStateJudgeScore`, OpenClaw-RL's PRM on `(a_t, s_{t+1})`),
      a turn with a next state is rewarded by it instead, as a sample of its own in its
      group's baseline (its own `episode_ids` entry); the final turn keeps the outcome, also
      when it has a next state (an episode cut at `max_turns`), so an episode that only calls
      tools until `max_turns` never ties with one that solved the task.
    - The four-way dispatch is per turn: a turn with neither a reward nor a hint is dropped.
    A failed episode (an environment error) is dropped whole and counted.

    With `mask_truncated` (TRL's `mask_truncated_completions`), an episode that ran out of
    tokens keeps its reward in its group's statistics but has no token in any loss. With
    `truncation_penalty` p > 0, such an episode's outcome is its score minus p (−p when it has
    none): running out of tokens is never free, also in a group whose every outcome is 0, where
    nothing else would tell a cut reply from a finished one.

    The hints make the rows' teacher contexts only with `teacher` (a head reads a teacher);
    with `hinted`, the first hinted turns of each group also get a reply sampled from their
    hinted context (`hinted.py`), as `RolloutBatch.hinted`. With `placebo_seed` every hint is
    first replaced by another problem's (`hint_check.placebo_hints`); with `check`, a teacher
    context is made only in the groups whose hinted teacher knows better (`hint_check.py`).

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
    prompts = batch["prompt_ids"]
    flat = [(i, ep) for i, group in enumerate(episodes) for ep in group]
    failed = [ep for _, ep in flat if ep.status == "failed"]
    if len(failed) == len(flat):
        raise ScoringError(
            f"every episode of rollout batch {batch['index']} failed (their errors are logged "
            f"above; the first: {failed[0].error if failed else None})"
        )
    live = [(i, ep) for i, ep in flat if ep.status != "failed"]
    # the outcome of each episode: the environment's reward, else the score provider's
    ask = [k for k, (_, ep) in enumerate(live) if ep.reward is None]
    finals = [live[k][1].turns[-1] for k in ask]
    outcome, failures = provider_values(
        score,
        "score",
        [live[k][1].problem for k in ask],
        [t.text for t in finals],
        [list(t.completion.token_ids) for t in finals],
    )
    ScoringError.raise_if_all_failed(outcome, failures)
    parts = provider_components(score)  # each reward function's own values (GDPO)
    logged, extra = provider_logs(score)  # its reward functions' metrics and columns
    extras = {ask[j]: {c: v[j] for c, v in extra.items() if j < len(v)} for j in range(len(ask))}
    rewards: list[float | None] = [ep.reward for _, ep in live]
    for k, value in zip(ask, outcome, strict=True):
        rewards[k] = value
    if truncation_penalty:
        for k, (_, ep) in enumerate(live):
            if ep.status == "truncated":
                rewards[k] = (rewards[k] or 0.0) - truncation_penalty
    # one row per turn, hinted (and with `turn_score`, scored) per turn
    turns = [(e, t) for e, (_, ep) in enumerate(live) for t in range(len(ep.turns))]
    hint_problems, hint_texts = [], []
    for e, t in turns:
        ep = live[e][1]
        turn = ep.turns[t]
        final = t == len(ep.turns) - 1 and not turn.has_next_state
        hint_problems.append(ep.problem if final else turn_problem(ep.problem, turn, t))
        hint_texts.append(turn.text)
    row_rewards = [rewards[e] for e, _ in turns]
    own = [False] * len(turns)  # rewarded as a sample of its own
    if turn_score is not None:
        scored = [  # every turn with a next state but the episode's last: that keeps the
            # outcome (an episode cut at max_turns ends on a next state, too)
            k
            for k, (e, t) in enumerate(turns)
            if live[e][1].turns[t].has_next_state and t < len(live[e][1].turns) - 1
        ]
        values, turn_failures = provider_values(
            turn_score,
            "score",
            [hint_problems[k] for k in scored],
            [hint_texts[k] for k in scored],
            [list(live[turns[k][0]][1].turns[turns[k][1]].completion.token_ids) for k in scored],
        )
        failures += turn_failures
        for k, value in zip(scored, values, strict=True):
            row_rewards[k], own[k] = value, True
        turn_logged, _ = provider_logs(turn_score)
        logged |= {f"turn_{name}": value for name, value in turn_logged.items()}
    hints, hint_failures = (
        provider_values(hint, "hint", hint_problems, hint_texts)
        if hint is not None
        else ([None] * len(turns), 0)
    )
    groups = [int(batch["index"]) * len(prompts) + live[e][0] for e, _ in turns]
    episodes_of = [(live[e][1], t) for e, t in turns]
    hints, row_hints, check_metrics = checked_hints(
        check, placebo_seed, tokenizer, episodes_of, groups, hints, hint_role, score, teacher
    )
    keep, counts = dispatch(
        [r is not None for r in row_rewards], [h is not None for h in row_hints]
    )
    if not keep:
        gated = any(hints) and not any(row_hints)
        raise ScoringError(
            f"no sample of rollout batch {batch['index']} has a usable score or an accepted "
            "hint: every sample was dropped"
            + (
                " (the hint check trusted no hint: rollout.hint_trust: always uses them unchecked)"
                if gated and check is not None
                else ""
            )
        )
    samples, kept = [], [turns[k] for k in keep]
    for k, (e, t) in zip(keep, kept, strict=True):
        ep = live[e][1]
        turn = ep.turns[t]
        samples.append(
            rollout_sample(
                tokenizer,
                turn.context,
                turn.context_ids,
                turn.completion,
                row_hints[k],
                hint_role,
                ep.tools,
            )
        )
    P = len(prompts)
    episode_index = {id(ep): n for n, (_, ep) in enumerate(flat)}
    rollout = pack_samples(
        samples,
        rewards=[row_rewards[k] for k in keep],
        group_ids=[int(batch["index"]) * P + live[e][0] for e, _ in kept],
        pad_id=tokenizer.pad_token_id or 0,
        max_response_length=max_tokens,
        engine_logprobs=[
            [0.0] * len(live[e][1].turns[t].context_ids) + live[e][1].turns[t].completion.logprobs
            for e, t in kept
        ],
    )
    rollout.episode_ids = torch.tensor(  # unique within the batch, where advantages are taken
        [
            len(flat) + k if own[k] else episode_index[id(live[e][1])]
            for k, (e, _) in zip(keep, kept, strict=True)
        ]
    )
    if parts is not None:  # a turn rewarded on its own, or by its environment: no parts
        by_episode = dict(zip(ask, parts[0], strict=True))
        nan = [math.nan] * len(parts[1])
        rollout.reward_components = torch.tensor(
            [
                nan
                if own[k] or e not in by_episode
                else [math.nan if v is None else v for v in by_episode[e]]
                for k, (e, _) in zip(keep, kept, strict=True)
            ],
            dtype=torch.float64,
        )
        rollout.reward_weights = tuple(parts[1])
    hinted_metrics = StepMetrics()
    shown: dict[int, dict[str, Any]] = {}  # each group's first hinted reply, for its sample row
    if hinted is not None:  # each turn's group id as its row's
        args = (tokenizer, episodes_of, groups, hints, hint_role, score)
        rollout.hinted, hinted_metrics, texts = hinted.from_turns(*args)
        for g, r, ok, text in zip(
            rollout.hinted.group_ids.tolist(),
            rollout.hinted.rewards.tolist(),
            rollout.hinted.has_reward.tolist(),
            texts,
            strict=True,
        ):
            shown.setdefault(g, {"hinted_reply": text, "hinted_reward": r if ok else None})
    truncated = torch.tensor([live[e][1].status == "truncated" for e, _ in kept])
    if mask_truncated:
        rollout.response_mask &= ~truncated[:, None]
        assert rollout.sdpo_mask is not None  # RolloutBatch.__post_init__ fills it
        rollout.sdpo_mask &= ~truncated[:, None]
    by_turn = {turns[k]: (row_rewards[k], hints[k]) for k in range(len(turns))}
    path = dict(zip(turns, map(signal_of, row_rewards, row_hints), strict=True))
    rows = [
        sample_row(ep, rewards[n], [by_turn[(n, t)] for t in range(len(ep.turns))])
        | ({"extra": extras[n]} if extras.get(n) else {})
        | shown.get(int(batch["index"]) * P + live[n][0], {})
        | (check.teacher_replies.get(int(batch["index"]) * P + live[n][0], {}) if check else {})
        | {"signal": [path[(n, t)] for t in range(len(ep.turns))]}
        for n, ep in first_of_groups(live)
    ][:samples_per_step]
    for kind, count in (("score", failures), ("hint", hint_failures)):
        if count:
            log.warning(
                "rollout batch %s: %d of %d %s calls failed (one line each above); those "
                "samples get no %s",
                batch["index"],
                count,
                len(ask) if kind == "score" else len(turns),
                kind,
                "reward" if kind == "score" else "hint",
            )
    if failed:
        log.warning(
            "rollout batch %s: %d of %d episodes failed (one line each above) and were dropped",
            batch["index"],
            len(failed),
            len(flat),
        )
    completions = [
        ep.turns[t].completion for e, (_, ep) in enumerate(live) for t in range(len(ep.turns))
    ]
    lengths = [len(c.token_ids) for c in completions]
    rewarded = torch.tensor([r for r in rewards if r is not None], dtype=torch.float)
    n, r = float(max(len(lengths), 1)), float(len(rewarded))
    metrics = StepMetrics()  # each with its reduction over ranks
    metrics.update(counts, kind="sum")
    metrics.mean("rollout/reward_mean", float(rewarded.mean()) if r else 0.0, weight=r)
    metrics.mean("rollout/reward_std", float(rewarded.std(unbiased=False)) if r else 0.0, weight=r)
    metrics.mean("rollout/response_length_mean", sum(lengths) / n, weight=n)
    metrics.max("rollout/response_length_max", float(max(lengths, default=0)))
    metrics.mean(
        "rollout/truncation_rate",
        sum(c.finish_reason == "length" for c in completions) / n,
        weight=n,
    )
    metrics.sum("rollout/masked_truncated", float(truncated.sum()) if mask_truncated else 0.0)
    metrics.sum("rollout/score_failures", float(failures))
    metrics.sum("rollout/hint_failures", float(hint_failures))
    metrics.sum(
        "rollout/judge_truncated",
        float(getattr(score, "truncated", 0) + getattr(hint, "truncated", 0)),
    )
    metrics.sum("rollout/tokens", float(sum(lengths)))
    for name, (value, weight) in logged.items():
        metrics.mean(name, value, weight=weight)
    metrics.include(hinted_metrics)
    metrics.include(check_metrics)
    if any(len(ep.turns) > 1 or ep.tools for _, ep in flat):  # episodes of several turns
        E = float(len(flat))
        metrics.mean("episode/turns", sum(len(ep.turns) for _, ep in flat) / E, weight=E)
        tooled = [ep for _, ep in flat if ep.tools]
        if tooled:  # episodes that had tools and never called one (no turn got a next state)
            silent = sum(not any(t.has_next_state for t in ep.turns) for ep in tooled)
            metrics.mean("episode/no_call_rate", silent / len(tooled), weight=len(tooled))
        for status in ("failed", "truncated", "max_turns"):
            metrics.sum(f"episode/{status}", float(sum(ep.status == status for _, ep in flat)))
        metrics.sum(
            "episode/tool_errors",
            float(
                sum(
                    t.next_state is not None and t.next_state.tool_error is not None
                    for _, ep in flat
                    for t in ep.turns
                )
            ),
        )
        metrics.sum(
            "episode/retokenized_differently",
            float(sum(ep.retokenized_differently for _, ep in flat)),
        )
    provider: Any
    for provider in (score, hint):  # counts are per step
        if getattr(provider, "truncated", 0):
            provider.truncated = 0
    return rollout, metrics, rows

"""From sampled completions to a `RolloutBatch`: score, hint, the four-way dispatch, packing.

The dispatch is a pure decision per sample (DESIGN.md): a usable score gives `has_reward`, an
accepted hint `has_teacher`; a sample with neither is dropped. Counts of each path are logged
as `dispatch/...`.

Score and hint providers fail per sample, alike: a provider call that raises as a whole, or
returns a value that is not a score (a finite number or None) or a hint (a string or None), is
a failure of the samples concerned — one warning line each, counted in
`rollout/score_failures` / `rollout/hint_failures`, one summary line per step — never a crashed
batch (unless every score failed: `ScoringError`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from composer_lightning.batch import RolloutBatch
from composer_lightning.chat import TraceSample, problem_messages, single_turn_teacher
from composer_lightning.datamodules.packing import pack_samples
from composer_lightning.distributed import StepMetrics
from composer_lightning.engines.base import Completion
from composer_lightning.tasks.base import HintProvider, ScoreProvider, ScoringError
from composer_lightning.tasks.calls import BadValue, as_hint, as_reward, hint_candidates

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


def provider_values(
    provider: ScoreProvider | HintProvider,
    kind: str,
    problems: list[dict[str, Any]],
    completions: list[str],
    completion_ids: list[list[int]] | None = None,
) -> tuple[list[Any], int]:
    """A provider's scores (`kind="score"`) or hints (`kind="hint"`) of one batch, checked.

    `completion_ids` go to a provider whose method takes a `completion_ids` argument
    (`FunctionScore`, for TRL-style reward functions); others get problems and texts only.

    Returns:
        One value per sample (None where it failed), and the number of failed samples: those
        the provider counted in its `failures` (reset here), plus every sample of a call that
        raised or returned the wrong number of values, plus each value of the wrong type.
    """
    n, name = len(problems), type(provider).__name__
    call = provider.score if kind == "score" else provider.hints
    extra = {"completion_ids": completion_ids} if _takes(call, "completion_ids") else {}
    try:
        values = list(call(problems, completions, **extra))
    except Exception as exc:  # a broken provider fails its samples, not the run
        log.warning(
            "%s provider %s raised on the whole batch (no sample gets a %s): %s: %s",
            kind,
            name,
            kind,
            type(exc).__name__,
            exc,
        )
        values = [None] * n
        failed = n
    else:
        failed = 0
        if len(values) != n:
            log.warning(
                "%s provider %s returned %d values for %d samples (no sample gets a %s)",
                kind,
                name,
                len(values),
                n,
                kind,
            )
            values, failed = [None] * n, n
    failed = max(failed, min(n, int(getattr(provider, "failures", 0) or 0)))
    if getattr(provider, "failures", 0):
        provider.failures = 0
    convert = as_reward if kind == "score" else as_hint
    out = []
    for i, value in enumerate(values):
        try:
            out.append(None if value is None else convert(value))
        except BadValue as exc:
            failed += 1
            log.warning(
                "%s provider %s returned %s on sample %d, expected %s (it gets no %s)",
                kind,
                name,
                exc.got,
                i,
                exc.expected,
                kind,
            )
            out.append(None)
    return out, min(failed, n)


def _takes(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def rollout_sample(
    tokenizer: Any,
    problem: dict[str, Any],
    prompt: list[int],
    c: Completion,
    hint: str | list[str] | None,
    hint_role: str,
) -> TraceSample:
    """One single-turn rollout as a tokenised sample, hinted teacher context included: the
    (first) hint's, and with a hint every candidate's, shortest hint first."""
    ids = list(prompt) + list(c.token_ids)
    response = [False] * len(prompt) + [True] * len(c.token_ids)
    hints = hint_candidates(hint)
    if not hints:
        return TraceSample(ids, response, None, [-1] * len(ids), [False] * len(ids), None)
    messages = problem_messages(problem)
    contexts = {
        h: single_turn_teacher(tokenizer, messages, c.token_ids, h, hint_role) for h in hints
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


def build_rollout(
    batch: dict[str, Any],
    outs: list[list[Completion]],
    tokenizer: Any,
    max_tokens: int,
    score: ScoreProvider,
    hint: HintProvider | None,
    hint_role: str,
    group_size: int,
    samples_per_step: int,
    mask_truncated: bool = False,
) -> tuple[RolloutBatch, StepMetrics, list[dict[str, Any]]]:
    """Score, hint, dispatch and pack the surviving samples of one prompt batch.

    With `mask_truncated` (TRL's `mask_truncated_completions`), a completion that reached
    `max_tokens` without a stop token keeps its reward in its group's statistics but has no
    token in any loss: its `response_mask` (and `sdpo_mask`) rows are all False.

    Returns:
        The rollout batch; the step's rollout metrics, each with its reduction over ranks
        (counts summed, means weighted by their samples, maxima); and one sample row (prompt,
        completion, reward, hint) for each of the first `samples_per_step` prompts.

    Raises:
        ScoringError: every score call failed, or every sample was dropped.
    """
    problems, prompts = batch["problems"], batch["prompt_ids"]
    flat = [(i, c) for i, group in enumerate(outs) for c in group]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in flat]
    flat_problems = [problems[i] for i, _ in flat]
    ids = [list(c.token_ids) for _, c in flat]
    scores, failures = provider_values(score, "score", flat_problems, texts, ids)
    hints, hint_failures = (
        provider_values(hint, "hint", flat_problems, texts)
        if hint is not None
        else ([None] * len(flat), 0)
    )
    ScoringError.raise_if_all_failed(scores, failures)
    keep, counts = dispatch([s is not None for s in scores], [h is not None for h in hints])
    if not keep:
        raise ScoringError(
            f"no sample of rollout batch {batch['index']} has a usable score or an accepted "
            "hint: every sample was dropped"
        )
    samples = [
        rollout_sample(
            tokenizer, problems[flat[k][0]], prompts[flat[k][0]], flat[k][1], hints[k], hint_role
        )
        for k in keep
    ]
    rollout = pack_samples(
        samples,
        rewards=[scores[k] for k in keep],
        group_ids=[int(batch["index"]) * len(prompts) + flat[k][0] for k in keep],
        pad_id=tokenizer.pad_token_id or 0,
        max_response_length=max_tokens,
        engine_logprobs=[[0.0] * len(prompts[flat[k][0]]) + flat[k][1].logprobs for k in keep],
    )
    truncated = torch.tensor([flat[k][1].finish_reason == "length" for k in keep])
    if mask_truncated:
        rollout.response_mask &= ~truncated[:, None]
        rollout.sdpo_mask &= ~truncated[:, None]
    rows = [  # the first sample of each of the first prompts: one row per prompt
        {
            "prompt": problem_messages(flat_problems[k])[-1]["content"],
            "completion": texts[k],
            "reward": scores[k],
            "hint": (hint_candidates(hints[k]) or [None])[0],
        }
        | ({"hint_candidates": hints[k]} if len(hint_candidates(hints[k])) > 1 else {})
        for k in range(0, len(flat), group_size)
    ][:samples_per_step]
    for kind, count in (("score", failures), ("hint", hint_failures)):
        if count:
            log.warning(
                "rollout batch %s: %d of %d %s calls failed (one line each above); those "
                "samples get no %s",
                batch["index"],
                count,
                len(flat),
                kind,
                "reward" if kind == "score" else "hint",
            )
    lengths = [len(c.token_ids) for _, c in flat]
    rewarded = torch.tensor([s for s in scores if s is not None], dtype=torch.float)
    n, r = float(len(flat)), float(len(rewarded))
    metrics = StepMetrics()  # each with its reduction over ranks
    metrics.update(counts, kind="sum")
    metrics.mean("rollout/reward_mean", float(rewarded.mean()) if r else 0.0, weight=r)
    metrics.mean("rollout/reward_std", float(rewarded.std(unbiased=False)) if r else 0.0, weight=r)
    metrics.mean("rollout/response_length_mean", sum(lengths) / n, weight=n)
    metrics.max("rollout/response_length_max", float(max(lengths)))
    metrics.mean(
        "rollout/truncation_rate", sum(c.finish_reason == "length" for _, c in flat) / n, weight=n
    )
    metrics.sum("rollout/masked_truncated", float(truncated.sum()) if mask_truncated else 0.0)
    metrics.sum("rollout/score_failures", float(failures))
    metrics.sum("rollout/hint_failures", float(hint_failures))
    metrics.sum(
        "rollout/judge_truncated",
        float(getattr(score, "truncated", 0) + getattr(hint, "truncated", 0)),
    )
    metrics.sum("rollout/tokens", float(sum(lengths)))
    for provider in (score, hint):  # counts are per step
        if getattr(provider, "truncated", 0):
            provider.truncated = 0
    return rollout, metrics, rows

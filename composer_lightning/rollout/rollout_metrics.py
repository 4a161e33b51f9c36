"""A rollout batch's step metrics (`rollout/...`, `dispatch/...`, `episode/...`), each with its
reduction over ranks (counts summed, means weighted by their samples, maxima), and the one
warning line per step each kind of failure gets (`dispatch.build_rollout` calls both)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_lightning.rollout.episodes import Episode
from composer_lightning.runtime.distributed import StepMetrics

log = logging.getLogger(__name__)


@dataclass
class Failures:
    """A rollout batch's failed provider calls and episodes, for the warnings and the metrics.

    Attributes:
        score: failed score calls, of `asked` (the episode outcomes asked of the score
            provider), the per-turn scores' failures included.
        hint: failed hint calls, of `turns`.
        episodes: the failed episodes, of `episode_count`.
    """

    score: int = 0
    hint: int = 0
    asked: int = 0
    turns: int = 0
    episodes: list[Episode] = field(default_factory=list)
    episode_count: int = 0

    def warn(self, index: Any) -> None:
        """One line per kind of failure of rollout batch `index` (each call's own line came
        before)."""
        for kind, count, of, loses in (
            ("score", self.score, self.asked, "reward"),
            ("hint", self.hint, self.turns, "hint"),
        ):
            if count:
                log.warning(
                    "rollout batch %s: %d of %d %s calls failed (one line each above); those "
                    "samples get no %s",
                    index,
                    count,
                    of,
                    kind,
                    loses,
                )
        if self.episodes:
            log.warning(
                "rollout batch %s: %d of %d episodes failed (one line each above) and were dropped",
                index,
                len(self.episodes),
                self.episode_count,
            )


def rollout_metrics(
    live: list[Episode],
    rewards: list[float | None],
    counts: dict[str, float],
    truncated: torch.Tensor | None,
    failures: Failures,
    judged: list[Any],
    logged: dict[str, tuple[float, float]],
) -> StepMetrics:
    """The batch's `rollout/...` and `dispatch/...` metrics.

    Args:
        live: the live episodes (their turns' completions give the lengths).
        rewards: each live episode's outcome (None: no usable score).
        counts: the dispatch's path counts.
        truncated: the kept rows cut at `max_tokens` that were masked (None: not masking).
        failures: the batch's failed calls.
        judged: the providers whose `truncated` count of judge replies cut short is logged
            (and reset: the counts are per step).
        logged: the reward functions' own metrics, `name -> (value, weight)`.
    """
    completions = [turn.completion for ep in live for turn in ep.turns]
    lengths = [len(c.token_ids) for c in completions]
    rewarded = torch.tensor([r for r in rewards if r is not None], dtype=torch.float)
    n, r = float(max(len(lengths), 1)), float(len(rewarded))
    metrics = StepMetrics()
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
    metrics.sum(
        "rollout/masked_truncated", float(truncated.sum()) if truncated is not None else 0.0
    )
    metrics.sum("rollout/score_failures", float(failures.score))
    metrics.sum("rollout/hint_failures", float(failures.hint))
    metrics.sum("rollout/judge_truncated", float(sum(getattr(p, "truncated", 0) for p in judged)))
    metrics.sum("rollout/tokens", float(sum(lengths)))
    for name, (value, weight) in logged.items():
        metrics.mean(name, value, weight=weight)
    for provider in judged:  # counts are per step
        if getattr(provider, "truncated", 0):
            provider.truncated = 0
    return metrics


def episode_metrics(episodes: list[Episode]) -> StepMetrics:
    """The `episode/...` metrics of a batch's episodes (failed ones included), logged when
    any has several turns or tools."""
    metrics = StepMetrics()
    if not any(len(ep.turns) > 1 or ep.tools for ep in episodes):
        return metrics
    E = float(len(episodes))
    metrics.mean("episode/turns", sum(len(ep.turns) for ep in episodes) / E, weight=E)
    tooled = [ep for ep in episodes if ep.tools]
    if tooled:  # episodes that had tools and never called one (no turn got a next state)
        silent = sum(not any(t.has_next_state for t in ep.turns) for ep in tooled)
        metrics.mean("episode/no_call_rate", silent / len(tooled), weight=len(tooled))
    for status in ("failed", "truncated", "max_turns"):
        metrics.sum(f"episode/{status}", float(sum(ep.status == status for ep in episodes)))
    errors = sum(
        t.next_state is not None and t.next_state.tool_error is not None
        for ep in episodes
        for t in ep.turns
    )
    metrics.sum("episode/tool_errors", float(errors))
    metrics.sum(
        "episode/retokenized_differently",
        float(sum(ep.retokenized_differently for ep in episodes)),
    )
    return metrics

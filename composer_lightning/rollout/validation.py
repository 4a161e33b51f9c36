"""Held-out evaluation: a split disjoint from training by construction, and its figures.

A problem is held out when a hash of its chat falls in the first `fraction` of the hash range:
the training stream skips such problems and the validation set draws only them, so no problem
(nor a duplicate of it drawn again) is ever on both sides. Validation runs through the same
engine as training, on the rollout callback's `on_validation_batch_start`, and is scored by
the run's own score provider (the one training rewards come from) unless another is given:
- `accuracy`: the share of prompts whose greedy completion scores at least `threshold`
  (default 1.0, an exact answer of a [0, 1] verifier);
- `pass@k`: the share of prompts with at least one of k sampled completions scoring at least
  `threshold` (k samples per prompt: the unbiased estimator of Chen et al. 2021 with n = k);
- `reward_mean`: the mean score of the sampled completions that got one (a reward function's
  own scale, whatever it is);
- `response_length`: the mean length, in tokens, of the sampled completions.
The module logs them as `val/...` through torchmetrics `MeanMetric`s
(`training/steplog.py`), each weighted by what it is a mean over (prompts, scored completions,
completions), which Lightning reduces over validation batches and ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from composer_lightning.chat import problem_messages
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.rollout.episodes import Episode, one_turn_episodes
from composer_lightning.rollout.providers import provider_logs, provider_values
from composer_lightning.rollout.sample_rows import sample_row
from composer_lightning.tasks.base import Problem, ScoreProvider


def problem_key(problem: Problem) -> str:
    """What identifies a problem: its chat, or the whole problem when it has none (a task
    whose environment opens the chat itself, e.g. an OpenEnv session's seed)."""
    if problem.get("messages") or problem.get("prompt") is not None:
        return json.dumps(problem_messages(problem), sort_keys=True)
    return json.dumps(problem, sort_keys=True, default=str)


def is_heldout(problem: Problem, fraction: float) -> bool:
    """Whether `problem` is in the held-out split (a hash of `problem_key`, so stable
    everywhere)."""
    h = int.from_bytes(hashlib.sha256(problem_key(problem).encode()).digest()[:8], "big")
    return h % 1_000_000 < fraction * 1_000_000


def evaluate(
    generate: Callable[[list[list[int]], int, SamplingConfig], list[list[Completion]]],
    score: ScoreProvider,
    tokenizer: Any,
    prompts: list[list[int]],
    problems: list[Problem],
    sampling: SamplingConfig,
    k: int,
    seed: int,
    threshold: float = 1.0,
    episodes: Callable[[list[list[int]], int, SamplingConfig], list[list[Episode]]] | None = None,
    replies: list[dict[str, Any]] | None = None,
) -> dict[str, tuple[float, float]]:
    """Accuracy, pass@k, mean reward and mean response length of one batch of held-out prompts.

    Args:
        generate: `(prompts, n, sampling) -> completions` through the run's engine (with
            tensor parallelism, generating the group's gathered prompts together), a score
            provider and the tokenizer that decodes completions.
        prompts, problems: the batch's prompt token ids and problems.
        sampling: the training sampling settings (temperature, max_tokens, stops).
        k: sampled completions per prompt for pass@k.
        seed: the sampling seed (fixed per batch: evaluation is reproducible).
        threshold: a completion solves its prompt when its score is at least this; a
            completion without a score (None) does not.
        episodes: `(prompts, n, sampling) -> episodes` for multi-turn tasks (`run_episodes`
            on the batch's problems): an episode is scored by its environment's outcome or the
            score provider on its final turn, its length is that of all its assistant turns.
            None: one turn per completion of `generate`.
        replies: where given, each prompt's greedy reply is appended to it as a row of
            `heldout.jsonl` (`sample_row`'s prompt and completion, or an episode's chat, with
            its score as `reward` and `solved`), for the run report.

    Returns:
        Each figure as `(value, weight)`: the weight is the number of things it is a mean
        over (prompts; scored completions; completions), for the mean over batches and ranks.
    """

    run = episodes or (
        lambda ids, n, s: one_turn_episodes(problems, ids, generate(ids, n, s), tokenizer)
    )

    logged: dict[str, tuple[float, float]] = {}  # the score's own metrics: (sum, weight)

    def scores(groups: list[list[Episode]]) -> list[list[float | None]]:
        flat = [ep for group in groups for ep in group]
        ask = [k for k, ep in enumerate(flat) if ep.reward is None and ep.status != "failed"]
        values, _ = provider_values(  # as training calls it (failures: per sample, not counted)
            score,
            "score",
            [flat[k].problem for k in ask],
            [flat[k].turns[-1].text for k in ask],
            [list(flat[k].turns[-1].completion.token_ids) for k in ask],
        )
        for name, (value, weight) in provider_logs(score)[0].items():  # its functions' logs
            if weight:
                total, count = logged.get(name, (0.0, 0.0))
                logged[name] = (total + value * weight, count + weight)
        out: list[float | None] = [None if ep.status == "failed" else ep.reward for ep in flat]
        for k, v in zip(ask, values, strict=True):
            out[k] = v
        it = iter(out)
        return [[next(it) for _ in group] for group in groups]

    def solved(value: float | None) -> bool:
        return value is not None and value >= threshold

    greedy_episodes = run(prompts, 1, replace(sampling, temperature=0.0, seed=seed))
    greedy = scores(greedy_episodes)
    if replies is not None:
        for (ep,), (value,) in zip(greedy_episodes, greedy, strict=True):
            if not ep.turns:  # an episode that failed before its first turn
                continue
            row = sample_row(ep, value, [(None, None)] * len(ep.turns))
            replies.append(
                {k: v for k, v in row.items() if k != "hint"} | {"solved": solved(value)}
            )
    groups = run(prompts, k, replace(sampling, seed=seed))
    sampled = scores(groups)
    rewards = [v for group in sampled for v in group if v is not None]
    lengths = [sum(len(t.completion.token_ids) for t in ep.turns) for g in groups for ep in g]
    n = float(len(prompts))
    return {name: (total / count, count) for name, (total, count) in logged.items()} | {
        "accuracy": (sum(solved(g[0]) for g in greedy) / n, n),
        f"pass@{k}": (sum(any(solved(v) for v in g) for g in sampled) / n, n),
        "reward_mean": (sum(rewards) / len(rewards) if rewards else 0.0, float(len(rewards))),
        "response_length": (sum(lengths) / len(lengths), float(len(lengths))),
    }


def validate_now(trainer: Any) -> None:
    """Run the fit's validation loop now, as Lightning runs it between two training batches
    (`_TrainingEpochLoop.on_advance_end`): its figures are logged at the current step. Used
    before the first step (`RolloutCallback(val_before_train=True)`)."""
    connector = trainer._logger_connector
    first_loop_iter = connector._first_loop_iter
    trainer.validating = True
    trainer.fit_loop.epoch_loop.val_loop.run()
    trainer.training = True
    connector._first_loop_iter = first_loop_iter

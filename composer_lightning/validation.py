"""Held-out evaluation: a split disjoint from training by construction, and its figures.

A problem is held out when a hash of its chat falls in the first `fraction` of the hash range:
the training stream skips such problems and the validation set draws only them, so no problem
(nor a duplicate of it drawn again) is ever on both sides. Validation runs through the same
engine as training, on the rollout callback's `on_validation_batch_start`:
- `greedy_accuracy`: the share of prompts whose greedy completion the verifier scores 1;
- `pass@k`: the share of prompts with at least one of k sampled completions scored 1 (k
  samples per prompt: the unbiased estimator of Chen et al. 2021 with n = k);
- `response_length`: the mean length, in tokens, of the sampled completions.
The module logs them as `val/...` through torchmetrics `MeanMetric`s weighted by the number of
prompts, which Lightning reduces over validation batches and ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning as L
from torchmetrics import MeanMetric

from composer_lightning.chat import problem_messages
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.tasks.base import Problem, ScoreProvider


def is_heldout(problem: Problem, fraction: float) -> bool:
    """Whether `problem` is in the held-out split (a hash of its chat, so stable everywhere)."""
    key = json.dumps(problem_messages(problem), sort_keys=True).encode()
    h = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
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
) -> dict[str, float]:
    """Greedy accuracy, pass@k and mean response length of one batch of held-out prompts.

    Args:
        generate: `(prompts, n, sampling) -> completions` through the run's engine (with
            tensor parallelism, generating the group's gathered prompts together), a score
            provider (the verifier) and the tokenizer that decodes completions.
        prompts, problems: the batch's prompt token ids and problems.
        sampling: the training sampling settings (temperature, max_tokens, stops).
        k: sampled completions per prompt for pass@k.
        seed: the sampling seed (fixed per batch: evaluation is reproducible).

    Returns:
        The figures, and `n`, the number of prompts (their weight).
    """

    def correct(outs: list) -> list[list[bool]]:
        texts = [
            [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
            for group in outs
        ]
        flat = score.score(
            [p for p, group in zip(problems, texts, strict=True) for _ in group],
            [t for group in texts for t in group],
        )
        it = iter(flat)
        return [[next(it) == 1.0 for _ in group] for group in texts]

    greedy = generate(prompts, 1, replace(sampling, temperature=0.0, seed=seed))
    sampled = generate(prompts, k, replace(sampling, seed=seed))
    lengths = [len(c.token_ids) for group in sampled for c in group]
    return {
        "greedy_accuracy": sum(g[0] for g in correct(greedy)) / len(prompts),
        f"pass@{k}": sum(any(g) for g in correct(sampled)) / len(prompts),
        "response_length": sum(lengths) / len(lengths),
        "n": float(len(prompts)),
    }


def log_validation(module: L.LightningModule, figures: dict[str, float]) -> None:
    """Log one batch's figures as `val/<name>` means over batches and ranks (weighted by n)."""
    figures = dict(figures)
    n = figures.pop("n")
    if not hasattr(module, "val_metrics"):
        raise TypeError("log_validation needs the module's `val_metrics` ModuleDict")
    for name, value in figures.items():
        key = name.replace("@", "_at_")  # a ModuleDict key
        if key not in module.val_metrics:
            module.val_metrics[key] = MeanMetric().to(module.device)
        module.val_metrics[key].update(value, weight=n)
        module.log(
            f"val/{name}",
            module.val_metrics[key],
            on_step=False,
            on_epoch=True,
            batch_size=int(n),
            metric_attribute=f"val_metrics.{key}",  # added after Lightning looked for metrics
        )

"""`RolloutCallback`: generate → score + hint → four-way dispatch → `RolloutBatch`; push weights.

Generation runs in `on_train_batch_start` (the prompt batch is filled in place under the key
`"rollout"`), so step k trains on rollouts of the weights after update k − 1. The push runs in
`on_train_batch_end`, after the rollout batch's last optimizer step, then the engine's prefix
cache is reset. On (re)start the engine is synced from the trainer's weights before it
generates.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from composer_lightning.batch import RolloutBatch
from composer_lightning.chat import TraceSample, problem_messages, single_turn_teacher
from composer_lightning.datamodules.packing import pack_samples
from composer_lightning.engines.base import Completion, RolloutEngine, SamplingConfig
from composer_lightning.engines.weights import iter_hf_weights
from composer_lightning.tasks.base import HintProvider, ScoreProvider, ScoringError, VerifierScore


class RolloutCallback(L.Callback):
    """Fresh rollouts from an inference engine every step, and the weight push after it.

    Args:
        engine: the inference engine (`VLLMEngine`, `HFEngine`, or any `RolloutEngine`).
        group_size: G, samples per prompt.
        sampling: temperature (must equal the module's), top_p = 1 and top_k off for training,
            max_tokens, stop ids (the tokenizer's eos is always added), seed.
        score: score provider; default the task verifier.
        hint: hint provider; None gives no teacher (no OPD/SDPO signal).
        hint_role: role of the message that carries the hint (`user` or `system`).
    """

    def __init__(self, engine: RolloutEngine, group_size: int = 4,
                 sampling: SamplingConfig | None = None, score: ScoreProvider | None = None,
                 hint: HintProvider | None = None, hint_role: str = "user"):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.engine, self.group_size = engine, group_size
        self.sampling = sampling or SamplingConfig()
        self.score = score if score is not None else VerifierScore()
        self.hint, self.hint_role = hint, hint_role
        self._last_start: float | None = None

    # ------------------------------------------------------------------ sync
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        temperature = getattr(pl_module, "temperature", self.sampling.temperature)
        if abs(temperature - self.sampling.temperature) > 1e-12:
            raise ValueError(f"the module's temperature ({temperature}) differs from the sampling "
                             f"temperature ({self.sampling.temperature}); log-probs must be those of "
                             "the sampling distribution: set both to the same value")
        self._push(pl_module)  # also re-syncs a resumed run from the restored weights

    def _push(self, pl_module: L.LightningModule) -> float:
        start = time.perf_counter()
        self.engine.load_weights(iter_hf_weights(pl_module.policy), version=pl_module.policy_version)
        return time.perf_counter() - start

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        push = self._push(pl_module)
        pl_module.log("rollout/push_time", push, on_step=True, batch_size=1)

    # ------------------------------------------------------------------ generate
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_start is not None:
            pl_module.log("time/step", now - self._last_start, on_step=True, prog_bar=True, batch_size=1)
        self._last_start = now
        dm = trainer.datamodule
        tokenizer = dm.tokenizer
        stops = sorted(set(self.sampling.stop_token_ids) | {tokenizer.eos_token_id})
        sampling = SamplingConfig(**{**vars(self.sampling), "stop_token_ids": stops})
        if self.sampling.seed is not None:  # a fresh, reproducible draw every step
            sampling.seed = self.sampling.seed + int(batch["index"])
        start = time.perf_counter()
        outs = self.engine.generate(batch["prompt_ids"], n=self.group_size, sampling=sampling)
        gen_time = time.perf_counter() - start
        if self.engine.weight_version != pl_module.policy_version:
            raise RuntimeError(f"engine weight version {self.engine.weight_version} != policy version "
                               f"{pl_module.policy_version}: the push did not happen")
        rollout, metrics = self.build(batch, outs, tokenizer, sampling.max_tokens)
        rollout.policy_version = self.engine.weight_version
        metrics["rollout/gen_time"] = gen_time
        metrics["rollout/tokens_per_s"] = metrics.pop("_tokens") / max(gen_time, 1e-9)
        batch["rollout"] = rollout.to(pl_module.device)
        dm.consumed = int(batch["index"]) + 1
        pl_module.log_dict(metrics, on_step=True, batch_size=rollout.batch_size)
        pl_module.log("reward", metrics["rollout/reward_mean"], on_step=True, prog_bar=True,
                      logger=False, batch_size=rollout.batch_size)

    def _sample(self, tokenizer: Any, problem: dict[str, Any], prompt: list[int], c: Completion,
                hint: str | None) -> TraceSample:
        """One single-turn rollout as a tokenised sample, hinted teacher context included."""
        ids = list(prompt) + list(c.token_ids)
        response = [False] * len(prompt) + [True] * len(c.token_ids)
        if hint is None:
            return TraceSample(ids, response, None, [-1] * len(ids), [False] * len(ids), None)
        teacher = single_turn_teacher(tokenizer, problem_messages(problem), c.token_ids, hint,
                                      self.hint_role)
        return TraceSample(ids, response, teacher.teacher_ids,
                           teacher.positions(len(prompt), len(ids)), response, None)

    def build(self, batch: dict[str, Any], outs: list[list[Completion]], tokenizer: Any,
              max_tokens: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Score, hint, dispatch, and pack the surviving samples."""
        problems, prompts = batch["problems"], batch["prompt_ids"]
        flat = [(i, c) for i, group in enumerate(outs) for c in group]
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in flat]
        flat_problems = [problems[i] for i, _ in flat]
        scores = self.score.score(flat_problems, texts)
        hints = self.hint.hints(flat_problems, texts) if self.hint is not None else [None] * len(flat)
        failures = getattr(self.score, "failures", 0)
        ScoringError.raise_if_all_failed(scores, min(failures, len(scores)))
        has_reward = [s is not None for s in scores]
        has_teacher = [h is not None for h in hints]
        keep = [k for k in range(len(flat)) if has_reward[k] or has_teacher[k]]
        counts = {"dispatch/opd_rl": sum(has_reward[k] and has_teacher[k] for k in range(len(flat))),
                  "dispatch/opd_only": sum(has_teacher[k] and not has_reward[k] for k in range(len(flat))),
                  "dispatch/rl_only": sum(has_reward[k] and not has_teacher[k] for k in range(len(flat))),
                  "dispatch/dropped": len(flat) - len(keep)}
        if not keep:
            raise ScoringError(f"no sample of rollout batch {batch['index']} has a usable score or "
                               "an accepted hint: every sample was dropped")
        samples = [self._sample(tokenizer, problems[flat[k][0]], prompts[flat[k][0]], flat[k][1],
                                hints[k]) for k in keep]
        rollout = pack_samples(samples, rewards=[scores[k] for k in keep],
                               group_ids=[int(batch["index"]) * len(prompts) + flat[k][0] for k in keep],
                               pad_id=tokenizer.pad_token_id or 0, max_response_length=max_tokens,
                               engine_logprobs=[[0.0] * len(prompts[flat[k][0]]) + flat[k][1].logprobs
                                                for k in keep])
        lengths = [len(flat[k][1].token_ids) for k in range(len(flat))]
        rewarded = torch.tensor([scores[k] for k in range(len(flat)) if has_reward[k]], dtype=torch.float)
        metrics = {
            **{k: float(v) for k, v in counts.items()},
            "rollout/reward_mean": float(rewarded.mean()) if len(rewarded) else 0.0,
            "rollout/reward_std": float(rewarded.std(unbiased=False)) if len(rewarded) else 0.0,
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": float(max(lengths)),
            "rollout/truncation_rate": sum(c.finish_reason == "length" for _, c in flat) / len(flat),
            "rollout/score_failures": float(failures),
            "rollout/hint_failures": float(getattr(self.hint, "failures", 0)),
            "_tokens": float(sum(lengths)),
        }
        for provider in (self.score, self.hint):  # counts are per step
            if getattr(provider, "failures", 0):
                provider.failures = 0
        return rollout, metrics


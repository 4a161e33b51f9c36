"""`RolloutCallback`: generate → score + hint → four-way dispatch → `RolloutBatch`; push weights.

Generation runs in `on_train_batch_start` (the prompt batch is filled in place under the key
`"rollout"`), so step k trains on rollouts of the weights after update k − 1. The push runs in
`on_train_batch_end`, after the rollout batch's last optimizer step, then the engine's prefix
cache is reset. On (re)start the engine is synced from the trainer's weights before it
generates.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Literal

import lightning as L

from composer_lightning.batch import RolloutBatch
from composer_lightning.callbacks.samples import write_samples
from composer_lightning.dispatch import build_rollout
from composer_lightning.distributed import StepMetrics, agree, world
from composer_lightning.engines.base import Completion, EngineContext, RolloutEngine, SamplingConfig
from composer_lightning.engines.weights import iter_hf_weights
from composer_lightning.errors import ConfigError
from composer_lightning.tasks.base import HintProvider, ScoreProvider, VerifierScore
from composer_lightning.validation import evaluate


def sampling_seed(
    base: int,
    step: int,
    rank: int,
    world_size: int,
    tensor_parallel_size: int,
    prompts: int,
    group_size: int,
) -> int:
    """The seed of one generate call: never repeated across steps or ranks.

    Engines seed prompt i, sample j of a call with `seed + i * G + j`, so a call uses the seeds
    `[seed, seed + prompts * G)`; the call of tensor-parallel group c at step s starts at
    `base + (s * groups + c) * prompts * G`, so no two calls' ranges overlap, and the ranks of
    one group (which must sample identically) share it.
    """
    groups = world_size // tensor_parallel_size
    return base + (step * groups + rank // tensor_parallel_size) * max(prompts, 1) * group_size


class RolloutCallback(L.Callback):
    """Fresh rollouts from an inference engine every step, and the weight push after it.

    Args:
        engine: the inference engine (`VLLMEngine`, `HFEngine`, or any `RolloutEngine`),
            configured here and started in `setup`, once per rank, after the trainer's process
            group and device exist. Without a model path it follows the policy's directory.
        group_size: G, samples per prompt.
        sampling: temperature (must equal the module's), top_p = 1 and top_k off for training,
            max_tokens, stop ids (the tokenizer's and the model's EOS ids are always added),
            seed (sampling seeds are a function of it, the step and the rank; None: drawn once).
        score: score provider; default the task verifier.
        hint: hint provider; None gives no teacher (no OPD/SDPO signal).
        hint_role: role of the message that carries the hint.
        samples_every_n_steps: every this many steps, `samples_per_step` of rank 0's samples
            (prompt, completion, reward, hint) go to `rollouts.jsonl` in the run directory and
            to TensorBoard's TEXT tab; 0 turns this off.
        samples_per_step: samples written each time.
        val_samples: k, the sampled completions per held-out prompt for `val/pass@k`
            (validation also decodes greedily: `val/greedy_accuracy`).
        val_score: how validation scores completions; default the task verifier.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        group_size: int = 4,
        sampling: SamplingConfig | None = None,
        score: ScoreProvider | None = None,
        hint: HintProvider | None = None,
        hint_role: Literal["user", "system"] = "user",
        samples_every_n_steps: int = 10,
        samples_per_step: int = 4,
        val_samples: int = 4,
        val_score: ScoreProvider | None = None,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if hint_role not in ("user", "system"):
            raise ValueError(f"hint_role must be 'user' or 'system', got {hint_role!r}")
        self.engine, self.group_size = engine, group_size
        self.sampling = sampling or SamplingConfig()
        if self.sampling.temperature == 0:
            raise ValueError("training rollouts must sample: sampling.temperature must be > 0")
        if val_samples < 1:
            raise ValueError(f"val_samples must be >= 1, got {val_samples}")
        self.val_samples = val_samples
        self.val_score = val_score if val_score is not None else VerifierScore()
        self.score = score if score is not None else VerifierScore()
        self.hint, self.hint_role = hint, hint_role
        if samples_every_n_steps < 0 or samples_per_step < 0:
            raise ValueError(
                f"samples_every_n_steps ({samples_every_n_steps}) and samples_per_step "
                f"({samples_per_step}) must be >= 0"
            )
        self.samples_every_n_steps, self.samples_per_step = samples_every_n_steps, samples_per_step
        self._samples: list[dict[str, Any]] = []
        self._last_start: float | None = None
        self._push_time = 0.0
        self._tp_group: Any = None
        self._base_seed = self.sampling.seed

    # ------------------------------------------------------------------ start and sync
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the configuration, then start the engine on this rank (and form its group)."""
        temperature = getattr(pl_module, "temperature", self.sampling.temperature)
        if abs(temperature - self.sampling.temperature) > 1e-12:
            raise ConfigError(
                f"the module's temperature ({temperature}) differs from the sampling "
                f"temperature ({self.sampling.temperature}); log-probs must be those "
                "of the sampling distribution: set both to the same value"
            )
        context = EngineContext.current(model_path=getattr(pl_module, "policy_path", None))
        tp = self.engine.tensor_parallel_size
        if context.world_size % tp:
            raise ConfigError(
                f"tensor_parallel_size {tp} does not divide the world size {context.world_size}"
            )
        if self._base_seed is None:  # a fresh draw per run, different on every rank
            self._base_seed = int.from_bytes(os.urandom(6), "little")
        self.engine.start(context)
        if tp > 1:  # every rank takes part in forming every group
            import torch.distributed as dist

            for first in range(0, context.world_size, tp):
                group = dist.new_group(list(range(first, first + tp)))
                if first <= context.rank < first + tp:
                    self._tp_group = group

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._push(pl_module)  # also re-syncs a resumed run from the restored weights

    def _push(self, pl_module: L.LightningModule) -> float:
        start = time.perf_counter()
        self.engine.load_weights(
            iter_hf_weights(pl_module.policy), version=pl_module.policy_version
        )
        return time.perf_counter() - start

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._push_time = self._push(pl_module)  # logged with the next step's metrics

    # ------------------------------------------------------------------ held-out evaluation
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.engine.weight_version != pl_module.policy_version:  # `validate` on a checkpoint
            self._push(pl_module)

    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Greedy and sampled completions of the held-out prompts: the batch's figures."""
        tokenizer = trainer.datamodule.tokenizer
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        sampling = replace(
            self.sampling, stop_token_ids=sorted(set(self.sampling.stop_token_ids) | set(eos))
        )
        seed = self._base_seed + 10**9 + batch_idx * len(batch["prompt_ids"]) * self.val_samples
        batch["val"] = evaluate(
            self.engine,
            self.val_score,
            tokenizer,
            batch["prompt_ids"],
            batch["problems"],
            sampling,
            self.val_samples,
            seed,
        )

    # ------------------------------------------------------------------ generate
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        metrics, rollout, error = StepMetrics(), None, None
        if self._last_start is not None:  # the previous step, push included
            metrics.max("time/step", now - self._last_start)
            metrics.max("rollout/push_time", self._push_time)
        self._last_start = now
        try:
            rollout = self._rollout(trainer, pl_module, batch, metrics)
        except Exception as exc:  # every rank raises it in this step (not one rank alone)
            error = exc
        reduced = agree(metrics, error)
        every = self.samples_every_n_steps
        if every and trainer.global_step % every == 0:
            write_samples(trainer, trainer.global_step, self._samples)
        batch["rollout"] = rollout.to(pl_module.device)
        trainer.datamodule.consumed = int(batch["index"]) + 1
        pl_module.log_dict(reduced, on_step=True, batch_size=rollout.batch_size)
        pl_module.log(
            "reward",
            reduced["rollout/reward_mean"],
            on_step=True,
            prog_bar=True,
            logger=False,
            batch_size=rollout.batch_size,
        )
        if "time/step" in reduced:
            pl_module.log(
                "s/step",
                reduced["time/step"],
                on_step=True,
                prog_bar=True,
                logger=False,
                batch_size=1,
            )

    def _rollout(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: dict[str, Any],
        metrics: StepMetrics,
    ) -> RolloutBatch:
        tokenizer = trainer.datamodule.tokenizer
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        sampling = replace(
            self.sampling, stop_token_ids=sorted(set(self.sampling.stop_token_ids) | set(eos))
        )
        start = time.perf_counter()
        outs = self._generate(batch["prompt_ids"], sampling, int(batch["index"]))
        gen_time = time.perf_counter() - start
        self.engine.sleep()  # frees the device for the update (CUDA sleep mode), else nothing
        if self.engine.weight_version != pl_module.policy_version:
            raise RuntimeError(
                f"engine weight version {self.engine.weight_version} != policy version "
                f"{pl_module.policy_version}: the push did not happen"
            )
        rollout, local, self._samples = build_rollout(
            batch,
            outs,
            tokenizer,
            sampling.max_tokens,
            self.score,
            self.hint,
            self.hint_role,
            self.group_size,
            self.samples_per_step,
        )
        rollout.policy_version = self.engine.weight_version
        tokens = local.pop("_tokens")
        n_rewarded = local.pop("_rewarded")
        for name, value in local.items():
            if name.startswith("dispatch/") or name.endswith(("_failures", "_truncated")):
                metrics.sum(name, value)
            elif name.endswith("_max"):
                metrics.max(name, value)
            elif name.startswith("rollout/reward"):
                metrics.mean(name, value, weight=n_rewarded)  # a mean over all ranks' samples
            else:
                metrics.mean(name, value, weight=len(outs) * self.group_size)
        metrics.max("rollout/gen_time", gen_time)
        metrics.sum("rollout/tokens_per_s", tokens / max(gen_time, 1e-9))
        return rollout

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, step: int
    ) -> list[list[Completion]]:
        """Generate this rank's prompts; with tensor parallelism the ranks of a group generate
        their gathered prompts together (as TRL's colocate mode does) and keep their own."""
        rank, size = world()
        tp = self.engine.tensor_parallel_size
        mine = prompts
        if tp > 1:
            import torch.distributed as dist

            parts: list[list[list[int]]] = [None] * tp  # type: ignore[list-item]
            dist.all_gather_object(parts, prompts, group=self._tp_group)
            offset = sum(len(p) for p in parts[: rank % tp])
            prompts = [p for part in parts for p in part]
        seed = sampling_seed(self._base_seed, step, rank, size, tp, len(prompts), self.group_size)
        outs = self.engine.generate(
            prompts, n=self.group_size, sampling=replace(sampling, seed=seed)
        )
        return outs if tp == 1 else outs[offset : offset + len(mine)]

"""`ComposerModule`: a LightningModule whose RL objective is a composition of loss heads.

Per rollout batch: the no-grad targets once (old and reference log-probs, ONE teacher forward
on the hinted contexts), then `ppo_epochs × minibatches` optimizer steps, each with one policy
forward (grad) and the public `Objective` (`objective.py`). The module never branches on head
type: heads declare what they read in `requires`. No step holds `[B, T, V]` logits.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from composer_lightning.batch import RolloutBatch
from composer_lightning.callbacks.precision import AbsorbedUpdates
from composer_lightning.callbacks.stop import CheckpointOnStop
from composer_lightning.canary import OutOfSyncError, check_canary
from composer_lightning.checkpoint import (
    LOOP_SETTINGS,
    check_loop_settings,
    load_state,
    save_state,
)
from composer_lightning.distributed import StepMetrics, agree, full
from composer_lightning.forward import rollout_targets, step_context
from composer_lightning.heads.base import Head
from composer_lightning.models.loading import (
    frozen_model,
    hparams_to_ignore,
    load_causal_lm,
    reference_model,
)
from composer_lightning.models.sharding import shard_fsdp2
from composer_lightning.objective import Aggregation, Mixing, Objective
from composer_lightning.step import RolloutTargets, StepContext
from composer_lightning.validation import log_validation

__all__ = ["ComposerModule", "OutOfSyncError"]


class ComposerModule(L.LightningModule):
    """RL post-training by composing loss heads (manual optimisation).

    Args:
        policy: a local HF model directory, or an `nn.Module` (e.g. given by `class_path`).
        heads: the loss heads; names must be unique.
        reference: frozen reference model (dir or module); by default a frozen copy of the
            policy, made only when a head reads reference log-probs.
        teacher: frozen teacher model; by default the live policy (no grad) on hinted contexts.
        optimizer: optimizer factory over the policy's parameters.
        lr_scheduler: optional scheduler factory, stepped once per rollout batch.
        clip_low: PPO ε_low, in (0, 1).
        clip_high: PPO ε_high (> 0; DAPO's clip-higher).
        dual_clip: dual-clip constant c > 1 for negative advantages, or None.
        aggregation: how per-token losses are reduced (`token_sum_norm` = Σ / (B · norm_length),
            the Dr. GRPO normaliser).
        norm_length: `token_sum_norm`'s length; default the batch's `max_response_length`.
        entropy_coef: entropy bonus coefficient.
        temperature: sampling temperature; log-probs are those of `logits / temperature`.
        mixing: `advantage` (one surrogate on the mixed advantage) or `loss` (one per term).
        variance_matching: name of a reference advantage head; every advantage term is rescaled
            by σ(reference) / σ(term) over its active tokens (detached). None disables it.
        ppo_epochs: passes over each rollout batch.
        minibatches: optimizer steps per pass, split along groups. Every optimizer step counts
            as one `trainer.global_step`: `max_steps` and head schedules count optimizer steps
            (rollout batches × ppo_epochs × minibatches).
        max_grad_norm: gradient clipping norm, or None.
        max_logprob_gap: canary threshold on mean |engine − trainer| log-prob; None disables it.
        chunk_size: tokens per LM-head chunk; None: ≈ 64 MiB of fp32 logits per chunk.
        activation_checkpointing: keep only each decoder layer's input for the backward and
            recompute the rest (HF gradient checkpointing): far less activation memory for
            about one more forward of the layers.
    """

    def __init__(
        self,
        policy: str | nn.Module,
        heads: list[Head],
        reference: str | nn.Module | None = None,
        teacher: str | nn.Module | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        aggregation: Aggregation = "token_sum_norm",
        norm_length: int | None = None,
        entropy_coef: float = 0.0,
        temperature: float = 1.0,
        mixing: Mixing = "advantage",
        variance_matching: str | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        max_grad_norm: float | None = 1.0,
        max_logprob_gap: float | None = 0.05,
        chunk_size: int | None = None,
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        live = dict(policy=policy, heads=heads, reference=reference, teacher=teacher)
        live.update(optimizer=optimizer, lr_scheduler=lr_scheduler)
        self.save_hyperparameters(ignore=hparams_to_ignore(**live))
        self.automatic_optimization = False
        self.objective = Objective(
            heads,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            aggregation=aggregation,
            entropy_coef=entropy_coef,
            mixing=mixing,
            variance_matching=variance_matching,
        )
        check_loop_settings(**{k: v for k, v in locals().items() if k in LOOP_SETTINGS})
        self.policy_path = policy if isinstance(policy, str) else None  # engines may follow it
        self.policy = load_causal_lm(policy)
        if activation_checkpointing:
            self.policy.gradient_checkpointing_enable({"use_reentrant": False})
        self.reference = reference_model(reference, self.policy, self.heads)
        self.teacher = frozen_model(teacher)
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.norm_length, self.temperature, self.chunk_size = norm_length, temperature, chunk_size
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.max_grad_norm, self.max_logprob_gap = max_grad_norm, max_logprob_gap
        self.policy_version = 0
        self.val_metrics = nn.ModuleDict()  # `val/...` means, filled by validation_step

    @property
    def heads(self) -> list[Head]:
        return self.objective.heads

    # ----------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """FSDP2 under ModelParallelStrategy (see `models.sharding.shard_fsdp2`)."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not getattr(self, "_fully_sharded", False):
            shard_fsdp2(self.policy, mesh["data_parallel"], str(self.trainer.precision))
            self._fully_sharded = True

    def configure_callbacks(self) -> list[L.Callback]:
        # always on: 16-bit weights that swallow updates are reported; a signal loses nothing
        return [AbsorbedUpdates(), CheckpointOnStop()]

    def configure_optimizers(self) -> Any:
        opt = self.optimizer_factory(self.policy.parameters())
        if self.lr_scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.lr_scheduler_factory(opt)}

    # ----------------------------------------------------------------- the public seams
    def rollout_targets(
        self,
        rb: RolloutBatch,
        needs: set[str],
        splits: list[Tensor] | None = None,
        updates: int = 1,
    ) -> RolloutTargets:
        """The no-grad values of a rollout batch, once, before its first of `updates` updates."""
        return rollout_targets(self, rb, needs, splits, updates)

    def step_context(
        self, mb: RolloutBatch, needs: set[str], targets: RolloutTargets | None = None
    ) -> StepContext:
        """One policy forward (grad) on a minibatch, with its rows of the rollout targets
        (computed here, for this minibatch alone, when not given)."""
        targets = targets if targets is not None else self.rollout_targets(mb, needs)
        return step_context(self, mb, targets, needs)

    # ----------------------------------------------------------------- the step
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        rb = batch["rollout"] if isinstance(batch, dict) else batch
        if not isinstance(rb, RolloutBatch):
            raise TypeError(
                f"training_step expects a RolloutBatch (or a dict with key 'rollout'), "
                f"got {type(rb).__name__}; is the rollout callback configured?"
            )
        opt = self.optimizers()
        splits, error = None, None
        try:
            splits = rb.group_splits(self.minibatches)
        except ValueError as exc:
            error = exc
        agree(error=error)  # a rank that cannot split its batch stops every rank, here
        updates = self.ppo_epochs * len(splits)
        needs = self.objective.requirements_over(self.global_step, updates)
        targets = self.rollout_targets(rb, needs, splits, updates)
        history: dict[str, list[float]] = defaultdict(list)
        canary = StepMetrics()
        for update in range(updates):
            idx = splits[update % len(splits)]
            mb = rb.select(idx)
            weights = self.objective.weights(self.global_step)
            ctx = self.step_context(mb, self.objective.requirements(weights), targets.select(idx))
            if update == 0:
                if targets.old_logprobs is None:  # a single update: the current log-probs
                    targets.old_logprobs = ctx.old_logprobs
                canary = check_canary(rb, targets.old_logprobs, self.max_logprob_gap)
                for head in self.heads:
                    head.on_rollout(rb, targets.old_logprobs)
            loss, metrics = self.objective(mb, ctx, weights)
            opt.zero_grad()
            self.manual_backward(loss)
            if self.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                metrics["train/grad_norm"] = full(norm)
            opt.step()
            for k, v in metrics.items():
                history[k].append(float(v))
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        self.policy_version += 1
        canary.update({k: sum(v) / len(v) for k, v in history.items()})
        self.log_dict(agree(canary), on_step=True, batch_size=rb.batch_size)
        last = history["train/loss"][-1]
        self.log("loss", last, prog_bar=True, logger=False, batch_size=rb.batch_size)
        return loss.detach()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Held-out figures the rollout callback computed for this batch (`validation.py`)."""
        log_validation(self, batch["val"])

    # ----------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["composer"] = save_state(self.policy_version, self.heads)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.policy_version = load_state(checkpoint.get("composer", {}), self.heads)

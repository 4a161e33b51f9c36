"""`ComposerModule`: a LightningModule whose RL objective is a composition of loss heads.

Per rollout batch: the no-grad targets once (old and reference log-probs, ONE teacher forward
on the hinted contexts), then `ppo_epochs × minibatches` optimizer steps, each with one policy
forward (grad) and the public `Objective` (`objective.py`). The module never branches on head
type: heads declare what they read in `requires`. No step holds `[B, T, V]` logits.
Its checkpoint hooks are `checkpoint.CheckpointHooks`; the step's forwards, targets,
micro-batches and objective each have a module of their own (`training/__init__.py`).

Why this file is long: `ComposerModule` is the class a run configures as `model:`, and its
forty options are documented on it (≈ 115 lines, what `--help` shows).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, cast

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from composer_lightning.callbacks.checkpoints import AtomicCheckpoints
from composer_lightning.callbacks.collapse import CollapseWatch
from composer_lightning.callbacks.precision import AbsorbedUpdates
from composer_lightning.callbacks.progress import in_place_of_the_default_bar
from composer_lightning.callbacks.steps import OptimizerSteps
from composer_lightning.callbacks.stop import CheckpointOnStop
from composer_lightning.heads.base import Head
from composer_lightning.models.dropout import without_dropout
from composer_lightning.models.loading import (
    absolute_spec,
    frozen_model,
    hparams_to_ignore,
    load_causal_lm,
    load_policy,
    reference_model,
)
from composer_lightning.models.lora import LoraConfig, lora_policy
from composer_lightning.models.sharding import data_parallel_mesh, shard_frozen, shard_fsdp2
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.protocols.step import RolloutTargets, StepContext
from composer_lightning.runtime.distributed import StepMetrics, agree, full
from composer_lightning.runtime.inputs import check_trainer_options
from composer_lightning.runtime.resume import (
    ConfiguredOptimizer,
    leave_frozen_out,
)
from composer_lightning.training import accumulate, padfree
from composer_lightning.training.canary import (
    CANARY_METRICS,
    OutOfSyncError,
    check_canary,
    default_max_logprob_gap,
    nonfinite_loss,
)
from composer_lightning.training.checkpoint import (
    LOOP_SETTINGS,
    CheckpointHooks,
    check_loop_settings,
)
from composer_lightning.training.entropy import AdaptiveEntropy
from composer_lightning.training.forward import Forwards, TokenScores, step_context
from composer_lightning.training.microbatch import MicroBatching, Plan
from composer_lightning.training.microbatch import plans as plan_micro_batches
from composer_lightning.training.objective import (
    Aggregation,
    LossMode,
    Mixing,
    Objective,
    RatioLevel,
)
from composer_lightning.training.refsync import ReferenceSync
from composer_lightning.training.steplog import log_step, log_validation
from composer_lightning.training.targets import rollout_targets

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer

__all__ = ["ComposerModule", "OutOfSyncError"]


class ComposerModule(CheckpointHooks, L.LightningModule):
    """RL post-training by composing loss heads (manual optimisation).

    Args:
        policy: a local HF model directory, a hub id (`org/name`, pinned as `org/name@rev`;
            fetched once into the hub cache, see `models/hub.py`), or an `nn.Module` (e.g.
            given by `class_path`). The hyper-parameters keep the id (a relative directory
            made absolute); `policy_path` is the local directory engines and tokenizer follow.
        heads: the loss heads; names must be unique.
        reference: frozen reference model (dir, hub id or module); by default a frozen copy of the
            policy, made only when a head reads reference log-probs.
        teacher: frozen teacher model (dir, hub id or module); by default the live policy (no grad) on hinted contexts.
        peft: a `peft.LoraConfig` (`class_path: peft.LoraConfig`): the policy is wrapped with
            LoRA adapters and only they train; the default reference is then the policy with
            its adapters off (no copy), and engines get the merged weights under the base
            model's names (`models/lora.py`). None: the whole policy trains.
        optimizer: optimizer factory over the policy's parameters.
        lr_scheduler: optional scheduler factory, stepped once per optimizer step.
        clip_low: PPO ε_low, in (0, 1).
        clip_high: PPO ε_high (> 0; DAPO's clip-higher).
        dual_clip: dual-clip constant c > 1 for negative advantages, or None.
        aggregation: how per-token losses are reduced (`token_sum_norm` = Σ / (B · norm_length),
            the Dr. GRPO normaliser).
        norm_length: `token_sum_norm`'s length; default the batch's `max_response_length`.
        entropy_coef: entropy bonus coefficient.
        temperature: the sampling temperature log-probs are taken at (`logits / temperature`).
            None (default): the rollout callback's `sampling.temperature`, so it is set in one
            place; 1.0 without a rollout callback. A value that differs from the sampling
            temperature is a configuration error.
        mixing: `advantage` (one surrogate on the mixed advantage) or `loss` (one per term).
        variance_matching: name of a reference advantage head; every advantage term is rescaled
            by σ(reference) / σ(term) over its active tokens (detached). None disables it.
        grad_norm_matching: name of a reference head (advantage or loss head); every head's
            weight is multiplied by ‖ĝ_ref‖ / ‖ĝ_h‖, the norms of the unweighted heads'
            gradients at the policy's final hidden states on the minibatch (all ranks),
            detached, so head h pulls with `w_h / w_ref` times the reference's gradient norm
            (weights and schedules stay ratios; equal weights, equal norms); a head (or
            reference) with a zero gradient keeps its weight; logged as `<head>/weight`. Unlike
            variance matching it scales loss heads too, by how strongly each moves the policy.
            Costs one backward through the chunked LM head per head every step (and, with
            micro-batches, keeps the minibatch's `[B, T, H]` states). Exclusive with
            `variance_matching`. None disables it.
        teacher_cap: a head that reads a hinted teacher (OPD, top-k OPD, SDPO) or imitates the
            hinted context's replies (context distillation) pulls on the policy at most
            `teacher_cap` (default 0.2: a fifth) times as hard as the other heads together (the
            RL signal), measured each minibatch at the final hidden states (context
            distillation's at its own replies'): a teacher's signal refines what RL learns
            (`Objective`). Logged as `<head>/weight` and `<head>/cap_scale`. None: uncapped
            (the behaviour before); ignored with either matching option.
        teacher_alone: under `teacher_cap`, the teacher heads' weight scale (in [0, 1]) on a
            minibatch where the other heads have no gradient (every group's replies score
            the same, so RL has no signal and a trusted teacher is the only one): default
            0.2, a fifth of its weight, as the cap; 0 keeps the teacher out there (the
            behaviour before).
        grad_share_every_n_steps: every N optimizer steps, log each head's `<head>/grad_norm`
            (‖g_h‖ at the final hidden states) and `<head>/grad_share` (<g_h, g> / ‖g‖², g the
            sum over heads: the shares sum to 1; a negative one pulls against the others),
            at the same per-head cost on those steps; every step with `grad_norm_matching`.
            0 (default): off.
        ppo_epochs: passes over each rollout batch.
        minibatches: optimizer steps per pass, split along groups. Every optimizer step counts
            as one `trainer.global_step`: `max_steps` and head schedules count optimizer steps
            (rollout batches × ppo_epochs × minibatches).
        max_grad_norm: gradient clipping norm, or None.
        skip_signal_free_updates: an optimizer step whose gradient is exactly 0 on every
            trainable parameter of every rank (no head had signal: every group's rewards equal,
            no teacher term, no loss head) leaves the weights and the optimizer's state as they
            are. False (default) steps the optimizer anyway, as TRL and verl do: AdamW then
            keeps moving the weights along its momentum (β1 0.9: about ten steps' worth of the
            last update, spread over the next steps; what that did on SmolLM2 once a hint head
            had ramped out: docs/benchmarks/smollm2_sparse.md, "A sparse task"). Logged either way as
            `train/signal_free` (the share of the step's updates without signal). Not with
            fp16's grad scaler (`precision: 16-mixed`), which must see a gradient each step.
        max_logprob_gap: canary threshold on mean |engine − trainer| log-prob; "auto": 1e-3
            when trainer and engine both compute in fp32, else 0.05; None disables it.
        importance_cap: a batch generated by an older weight version (`max_staleness` > 0 on
            the rollout callback) weights the surrogate's tokens by `min(π_old / π_engine,
            importance_cap)`; None turns the correction off.
        max_tokens_per_micro_batch: padded tokens (rows × longest row) per forward; a
            minibatch is cut into micro-batches of about this many, its loss and gradients
            those of the whole minibatch exactly (`microbatch.py`), its gradients synced once
            per optimizer step. None: no token budget (verl's `ppo_max_token_len_per_gpu`).
        micro_batch_size: rows per forward (TRL's `per_device_train_batch_size` within a
            minibatch); None: no row limit. Both None: one forward per minibatch.
        chunk_size: tokens per LM-head chunk; None: ≈ 8 MiB of fp32 logits per chunk on CPU (64 MiB
            on an accelerator), at least H / 8 tokens.
        padding_free: the step's forwards run the rows as a few forwards of like length, each
            cut to its longest row, so the decoder does no work on right padding; the loss and
            gradients are the padded step's (`padfree.py`; TRL's `padding_free`). A model FSDP2
            shards runs one forward regardless. False: one padded forward each.
        activation_checkpointing: keep only each decoder layer's input for the backward and
            recompute the rest (HF gradient checkpointing): far less activation memory for
            about one more forward of the layers.
        loss_mode: the surrogate of the advantage heads: `clip` (PPO's clipped ratio), `cispo`
            (MiniMax-M1: the ratio capped at 1 + clip_high, a detached weight on log π) or
            `sapo` (a soft gate, `sapo_temperature_pos` / `_neg`); TRL's `loss_type` values
            `cispo` and `sapo` (`functional.policy_loss`).
        importance_sampling_level: `token`; `sequence` (GSPO: one ratio per response, the mean
            log-ratio; refused beside a head with per-token advantages such as OPD) or
            `sequence_token` (GSPO-token: the sequence's ratio, each token's own gradient).
        sapo_temperature_pos: SAPO's gate temperature for A > 0.
        sapo_temperature_neg: SAPO's gate temperature for A ≤ 0.
        top_entropy_quantile: train the surrogate on the top share of response tokens by
            entropy only (across ranks; TRL's `top_entropy_quantile`, 0.2 in its paper);
            1 (default): every token.
        ref_model_sync_steps: every N optimizer steps the reference becomes `α·policy + (1 −
            α)·reference` (TR-DPO; TRL's `sync_ref_model`), α = `ref_model_mixup_alpha`; the
            synced reference is then saved in checkpoints. 0 (default): a fixed reference.
            Refused without a head that reads the reference, and with LoRA.
        ref_model_mixup_alpha: the policy's share of each sync, in (0, 1].
        adaptive_entropy: the entropy bonus's coefficient follows the entropy (Skywork-OR1;
            TRL's `use_adaptive_entropy`): `{target, delta, coef_min, coef_max}`, starting from
            `entropy_coef`; saved in checkpoints (`training/entropy.py`). None: fixed.
        model_init_kwargs: `from_pretrained` options of the policy, reference and teacher
            loads (TRL's `model_init_kwargs`), e.g. `{attn_implementation: eager}` or `{dtype:
            bfloat16}` (default fp32; the trainer's `precision` is the usual way to train in
            16 bits). Modules given as objects are used as they are.
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask: drop
            negative-advantage tokens of responses whose mean `log μ − log π` exceeds it (μ the
            engine's log-probs); None (default): off.
        allow_head_changes: resuming from a checkpoint with heads added or removed drops the
            removed heads' saved state and starts the added ones fresh; False (default) makes
            that a configuration error. Other differences from the checkpoint's configuration
            are honoured or refused as `runtime/resume.py` says.
    """

    def __init__(
        self,
        policy: str | nn.Module,
        heads: list[Head],
        reference: str | nn.Module | None = None,
        teacher: str | nn.Module | None = None,
        peft: LoraConfig | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        aggregation: Aggregation = "token_sum_norm",
        norm_length: int | None = None,
        entropy_coef: float = 0.0,
        temperature: float | None = None,
        mixing: Mixing = "advantage",
        variance_matching: str | None = None,
        grad_norm_matching: str | None = None,
        teacher_cap: float | None = 0.2,
        teacher_alone: float = 0.2,
        grad_share_every_n_steps: int = 0,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        max_grad_norm: float | None = 1.0,
        skip_signal_free_updates: bool = False,
        max_logprob_gap: float | Literal["auto"] | None = "auto",
        importance_cap: float | None = 2.0,
        max_tokens_per_micro_batch: int | None = None,
        micro_batch_size: int | None = None,
        chunk_size: int | None = None,
        padding_free: bool = True,
        activation_checkpointing: bool = False,
        loss_mode: LossMode = "clip",
        importance_sampling_level: RatioLevel = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: float | None = None,
        ref_model_sync_steps: int = 0,
        ref_model_mixup_alpha: float = 0.6,
        model_init_kwargs: dict[str, Any] | None = None,
        adaptive_entropy: AdaptiveEntropy | None = None,
        allow_head_changes: bool = False,
    ):
        super().__init__()
        live: dict[str, Any] = dict(
            policy=policy, heads=heads, reference=reference, teacher=teacher, peft=peft
        )
        live.update(optimizer=optimizer, lr_scheduler=lr_scheduler)
        self.save_hyperparameters(ignore=hparams_to_ignore(**live))
        for name in ("policy", "reference", "teacher"):  # readable from any working directory
            if name in self.hparams:
                self.hparams[name] = absolute_spec(self.hparams[name])
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
            importance_cap=importance_cap,
            grad_norm_matching=grad_norm_matching,
            teacher_cap=teacher_cap,
            teacher_alone=teacher_alone,
            loss_mode=loss_mode,
            importance_sampling_level=importance_sampling_level,
            sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg,
            top_entropy_quantile=top_entropy_quantile,
            off_policy_mask_threshold=off_policy_mask_threshold,
            adaptive_entropy=adaptive_entropy,
        )
        n = grad_share_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"grad_share_every_n_steps must be an integer >= 0, got {n!r}")
        self.grad_share_every_n_steps = n
        check_loop_settings(**{k: v for k, v in locals().items() if k in LOOP_SETTINGS})
        # resolved once: engines and the data module's tokenizer follow this local directory
        self.policy_path: str | None = None
        if model_init_kwargs is not None and not isinstance(model_init_kwargs, dict):
            raise ValueError(
                f"model_init_kwargs must be a mapping of from_pretrained options, got "
                f"{model_init_kwargs!r}"
            )
        init = model_init_kwargs
        if isinstance(policy, str):
            self.policy_path, self.policy = load_policy(policy, init_kwargs=init)
        else:
            self.policy = load_causal_lm(policy)
        if peft is not None:
            self.policy = lora_policy(self.policy, peft)
        without_dropout(self.policy)  # every forward of the step deterministic (models/dropout.py)
        self._policy_files: dict[str, bytes] | None = None
        if activation_checkpointing:
            self.policy.gradient_checkpointing_enable({"use_reentrant": False})  # type: ignore[operator]  # HF's
        self.reference = reference_model(reference, self.policy, self.heads, init)
        self.teacher = frozen_model(teacher, "model.teacher", init)
        self.reference_sync = ReferenceSync(ref_model_sync_steps, ref_model_mixup_alpha)
        self.reference_sync.check(self.policy, self.reference, peft is not None)
        # rebuilt from the configuration: never in a checkpoint, but for a reference that syncs
        leave_frozen_out(self, keep=("reference",) if self.reference_sync.enabled else ())
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.norm_length, self.chunk_size = norm_length, chunk_size
        if not isinstance(padding_free, bool):
            raise ValueError(f"padding_free must be true or false, got {padding_free!r}")
        self.padding_free = padding_free
        self.configured_temperature = temperature  # None: the sampler's (RolloutCallback.setup)
        self.temperature = 1.0 if temperature is None else temperature
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.micro_batching = MicroBatching(max_tokens_per_micro_batch, micro_batch_size)
        self.max_grad_norm, self.max_logprob_gap = max_grad_norm, max_logprob_gap
        self.skip_signal_free_updates = bool(skip_signal_free_updates)
        self.policy_version = 0
        self.allow_head_changes = allow_head_changes
        self._restored_rng: dict[str, Any] | None = None
        self._configured: ConfiguredOptimizer | None = None  # as built, before a checkpoint's
        self._resumed_scheduler: bool | None = None  # set on resume: the checkpoint has one
        self.val_metrics = nn.ModuleDict()  # `val/...` means, filled by validation_step

    @property
    def heads(self) -> list[Head]:
        return self.objective.heads

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps per rollout batch: `ppo_epochs × minibatches`."""
        return self.ppo_epochs * self.minibatches

    # ----------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """FSDP2 under ModelParallelStrategy: the policy (`models.sharding.shard_fsdp2`) and the
        frozen reference and teacher (`shard_frozen`), each rank holding 1/N of every model; a
        tensor-parallel mesh dimension is refused (`models.sharding.data_parallel_mesh`)."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not getattr(self, "_fully_sharded", False):
            dp, precision = data_parallel_mesh(mesh), str(self.trainer.precision)
            shard_fsdp2(self.policy, dp, precision)
            for frozen in (self.reference, self.teacher):
                # a LoRA policy's reference holds no weights: its forward is the policy's
                if frozen is not None and next(frozen.parameters(), None) is not None:
                    shard_frozen(frozen, dp, precision)
            self._fully_sharded = True

    def configure_callbacks(self) -> list[L.Callback]:
        # always on: 16-bit weights that swallow updates are reported; a signal loses nothing;
        # a checkpoint is whole or not written
        # Lightning checks these next, in its own words
        check_trainer_options(
            self.trainer, self.micro_batching.enabled, self.skip_signal_free_updates
        )
        # progress in optimizer steps, not Lightning's "Epoch 0/-2" of an endless stream
        bar = in_place_of_the_default_bar(self.trainer)
        # a collapse is said as it happens, with the trainer's own thresholds if it has a watch
        watched = any(isinstance(c, CollapseWatch) for c in self.trainer.callbacks)  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        watch = [] if watched else [CollapseWatch()]
        steps = OptimizerSteps(self.updates_per_batch)  # one step axis
        return bar + watch + [steps, AbsorbedUpdates(), CheckpointOnStop(), AtomicCheckpoints()]

    def configure_optimizers(self) -> Any:
        opt, sched = self._optimizer_and_scheduler(self.trainable_parameters())
        self._configured = ConfiguredOptimizer.of(opt, sched)
        return opt if sched is None else {"optimizer": opt, "lr_scheduler": sched}

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The policy's parameters that train (a LoRA policy's adapters): the optimizer's."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def _optimizer_and_scheduler(self, params: Any) -> tuple[torch.optim.Optimizer, Any]:
        opt = self.optimizer_factory(params)
        return opt, None if self.lr_scheduler_factory is None else self.lr_scheduler_factory(opt)

    # ----------------------------------------------------------------- the public seams
    @property
    def forwards(self) -> Forwards:
        """The models and settings the step's forwards read (`forward.py`)."""
        return Forwards(
            self.policy,
            self.reference,
            self.teacher,
            self.temperature,
            self.chunk_size,
            entropy=self.objective.entropy_coef > 0,
            topk=self.objective.topk(),
        )

    def rollout_targets(
        self,
        rb: RolloutBatch,
        needs: set[str],
        splits: list[Tensor] | None = None,
        updates: int = 1,
        plans: list[Plan] | None = None,
        behavior_logprobs: Tensor | None = None,
    ) -> RolloutTargets:
        """The no-grad values of a rollout batch, once, before its first of `updates` updates
        (per micro-batch of each minibatch with `plans`)."""
        return rollout_targets(self.forwards, rb, needs, splits, updates, plans, behavior_logprobs)

    def step_context(
        self,
        mb: RolloutBatch,
        needs: set[str],
        targets: RolloutTargets | None = None,
        scores: TokenScores | None = None,
        rollout: RolloutBatch | None = None,
        rows: Tensor | None = None,
    ) -> StepContext:
        """One policy forward (grad) on a minibatch, with its rows of the rollout targets
        (computed here, for this minibatch alone, when not given); given `scores` (a
        micro-batched step's outputs), no forward. `rollout` and `rows`: the whole rollout
        batch and the minibatch's rows of it, whose batch statistics heads take."""
        targets = targets if targets is not None else self.rollout_targets(mb, needs)
        return step_context(
            self.forwards,
            mb,
            targets,
            needs,
            global_step=self.global_step,
            aggregation=self.objective.aggregation,
            norm_length=self.norm_length,
            scores=scores,
            rollout=rollout,
            rows=rows,
        )

    # ----------------------------------------------------------------- the step
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        with padfree.padding_free(self.padding_free):
            return self._training_step(batch)

    def _training_step(self, batch: Any) -> Tensor:
        rb = batch.rollout if isinstance(batch, PromptBatch) else batch
        if not isinstance(rb, RolloutBatch):
            raise TypeError(
                f"training_step expects a RolloutBatch (or a dict with key 'rollout'), "
                f"got {type(rb).__name__}; is the rollout callback configured?"
            )
        opt = cast("LightningOptimizer", self.optimizers())  # one optimizer, one scheduler or none
        sched = cast("torch.optim.lr_scheduler.LRScheduler | None", self.lr_schedulers())
        splits, error = None, None
        try:
            splits = rb.group_splits(self.minibatches)
        except ValueError as exc:
            error = exc
        agree(error=error)  # a rank that cannot split its batch stops every rank, here
        assert splits is not None  # (else agree raised)
        updates = self.ppo_epochs * len(splits)
        needs = self.objective.requirements_over(self.global_step, updates)
        plans = (
            plan_micro_batches(rb, splits, self.micro_batching)
            if self.micro_batching.enabled
            else None
        )
        # generated ahead, by an older version (a batch without a version stamp is taken as on
        # policy: synthetic or recorded data, nothing to correct against)
        stale = rb.policy_version is not None and rb.policy_version != self.policy_version
        # a shaped sampler (top-k, min-p, penalties) is a behaviour policy of its own: its
        # log-probs weight the surrogate as a stale batch's do
        behavior = rb.engine_logprobs if stale or rb.sampler_shaped else None
        targets = self.rollout_targets(rb, needs, splits, updates, plans, behavior)
        history: dict[str, list[float]] = defaultdict(list)
        canary = StepMetrics()
        step_metrics = StepMetrics()
        if rb.metrics is not None:  # the rollout side's, reduced with the module's, once
            step_metrics.include(rb.metrics)
        for update in range(updates):
            part = update % len(splits)
            idx = splits[part]
            mb = rb.select(idx)
            weights = self.objective.weights(self.global_step)
            requirements = self.objective.requirements(weights)
            plan = None if plans is None else plans[part]
            measure = self._measures_gradients()
            at_states = measure or self.objective.measures_gradients(weights)
            scores = (
                None
                if plan is None
                else accumulate.outputs(self.forwards, mb, plan, requirements, states=at_states)
            )
            ctx = self.step_context(mb, requirements, targets.select(idx), scores, rb, idx)
            if update == 0:
                if targets.old_logprobs is None:  # a single update: the current log-probs
                    targets = replace(targets, old_logprobs=ctx.old_logprobs)
                assert targets.old_logprobs is not None  # (set just above if it was not)
                canary = check_canary(rb, targets.old_logprobs, self._max_gap(rb), stale)
                if rb.policy_version is not None:
                    canary.max("rollout/staleness", self.policy_version - rb.policy_version)
                for head in self.heads:
                    head.on_rollout(rb, targets.old_logprobs)
            loss, metrics = self.objective(mb, ctx, weights, measure_gradients=measure)
            # before the backward's collectives: a NaN on any rank stops every rank here
            agree(error=nonfinite_loss(loss, self.policy_version))
            opt.zero_grad()
            if plan is None:
                self.manual_backward(loss)
            else:
                assert scores is not None  # computed for a plan
                accumulate.backward(
                    self.forwards, loss, scores, mb, plan, requirements, self.manual_backward
                )
            # the context holds the minibatch's [B, T, H] hidden states: not into the next
            # update's forward
            del ctx, scores
            # the norm over every rank (DDP's reduced gradients, FSDP2's full norm): one
            # decision on every rank
            params = self.trainable_parameters()
            if self.max_grad_norm is not None:
                norm = full(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
                metrics["train/grad_norm"] = norm
            else:
                grads = [p.grad for p in params if p.grad is not None]
                norm = full(torch.nn.utils.get_total_norm(grads)) if grads else torch.zeros(())
            signal_free = float(norm) == 0.0
            metrics["train/signal_free"] = float(signal_free)
            if signal_free and self.skip_signal_free_updates:
                for p in params:  # the optimizer skips a parameter
                    p.grad = None  # without a gradient: no momentum step, no weight decay
            opt.step()
            if sched is not None:  # one step axis: the schedule counts optimizer steps too
                sched.step()
            self.reference_sync.after_step(self.global_step, self.policy, self.reference)
            self.objective.end_step()  # the adaptive entropy controller's update
            for k, v in metrics.items():
                history[k].append(float(v))
        step_metrics.update(canary.local(), kind="max")  # reduced already: equal on every rank
        step_metrics.update({k: sum(v) / len(v) for k, v in history.items()})
        reduced = agree(step_metrics)  # the step's one reduction of its metrics
        bar = {"loss": history["train/loss"][-1], "reward": reduced.get("rollout/reward_mean")}
        bar["s/step"] = reduced.get("time/step")
        shown = {k: v for k, v in bar.items() if v is not None}
        for name in CANARY_METRICS:  # a step that compared nothing shows no old figures
            if name not in reduced:
                self.trainer.callback_metrics.pop(name, None)
        log_step(self.trainer, self.global_step - 1, reduced, shown, updates)
        self.policy_version += 1
        return loss.detach()

    def _measures_gradients(self) -> bool:
        """Whether this optimizer step logs the heads' gradient shares (the same on every
        rank: the measurement is a collective)."""
        n = self.grad_share_every_n_steps
        return n > 0 and self.global_step % n == 0

    def _max_gap(self, rb: RolloutBatch) -> float | None:
        if self.max_logprob_gap != "auto":
            return self.max_logprob_gap
        return default_max_logprob_gap(self.trainer.precision, rb.engine_dtype)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Held-out figures the rollout callback computed for this batch (`rollout/validation.py`)."""
        log_validation(self, batch.val)

"""`ComposerModule`: a LightningModule whose RL objective is a composition of loss heads.

Per minibatch: one policy forward (grad), ONE teacher forward (no grad) shared by every head
that reads the teacher, a reference forward when a head needs it; then
`A = Σ w_i · advantages_i` over advantage heads → ONE clipped surrogate, `+ Σ w_j · loss_j`.
The module never branches on head type: heads declare what they read in `requires`.
"""

from __future__ import annotations

import copy
import math
import random
from collections import defaultdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from composer_lightning.batch import RolloutBatch
from composer_lightning.functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_aggregate,
    policy_loss,
)
from composer_lightning.functional.align import gather_teacher_logits, teacher_alignment
from composer_lightning.heads.base import Head
from composer_lightning.mixer import AdvantageTerm, masked_stats, variance_scales
from composer_lightning.models.loading import load_causal_lm
from composer_lightning.step import StepContext, forward_logits, shift_logits

_MIXINGS = ("advantage", "loss")
_TEACHER = {"teacher_logprobs", "teacher_logits"}


class OutOfSyncError(RuntimeError):
    """The engine's log-probs disagree with the trainer's: the weight push is broken."""


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
        clip_low: PPO ε_low. clip_high: PPO ε_high. dual_clip: dual-clip c > 1, or None.
        aggregation: `token_mean`, `seq_mean_token_mean`, `seq_mean_token_sum` or
            `token_sum_norm` (Σ / (B · norm_length), the Dr. GRPO normaliser).
        norm_length: `token_sum_norm`'s length; default the batch's `max_response_length`.
        entropy_coef: entropy bonus coefficient.
        temperature: sampling temperature; log-probs are those of `logits / temperature`.
        mixing: `advantage` (one surrogate on the mixed advantage) or `loss` (one surrogate per
            advantage term, summed; for ablations).
        variance_matching: name of a reference advantage head; every advantage term is rescaled
            by σ(reference) / σ(term) over its active tokens (detached). None disables it.
        ppo_epochs: passes over each rollout batch. minibatches: optimizer steps per pass.
        max_grad_norm: gradient clipping norm, or None.
        max_logprob_gap: canary threshold on mean |engine − trainer| log-prob; None disables it.
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
        aggregation: str = "token_sum_norm",
        norm_length: int | None = None,
        entropy_coef: float = 0.0,
        temperature: float = 1.0,
        mixing: str = "advantage",
        variance_matching: str | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        max_grad_norm: float | None = 1.0,
        max_logprob_gap: float | None = 0.05,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=_live_objects(policy=policy, heads=heads, reference=reference,
                                                       teacher=teacher, optimizer=optimizer,
                                                       lr_scheduler=lr_scheduler))
        self.automatic_optimization = False
        self.heads = _check_heads(heads)
        _check_settings(clip_low, clip_high, dual_clip, aggregation, norm_length, entropy_coef,
                        temperature, mixing, ppo_epochs, minibatches, max_grad_norm, max_logprob_gap)
        names = [h.name for h in self.heads]
        if variance_matching is not None and variance_matching not in names:
            raise ValueError(f"variance_matching names head {variance_matching!r}, which is not "
                             f"among the heads {names}")
        self.policy = load_causal_lm(policy)
        needs_ref = any("ref_logprobs" in h.requires and h.weight > 0 for h in self.heads)
        self.reference = _frozen(reference if reference is not None
                                 else copy.deepcopy(self.policy) if needs_ref else None)
        self.teacher = _frozen(teacher)
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.aggregation, self.norm_length, self.entropy_coef = aggregation, norm_length, entropy_coef
        self.temperature, self.mixing, self.variance_matching = temperature, mixing, variance_matching
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.max_grad_norm, self.max_logprob_gap = max_grad_norm, max_logprob_gap
        self.policy_version = 0

    # ----------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """FSDP2: shard each decoder layer and the root when run under ModelParallelStrategy."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or getattr(self, "_fully_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["data_parallel"]
        for layer in getattr(getattr(self.policy, "model", None), "layers", []):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.policy, mesh=dp_mesh)
        self._fully_sharded = True

    def configure_optimizers(self) -> Any:
        opt = self.optimizer_factory(self.policy.parameters())
        if self.lr_scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.lr_scheduler_factory(opt)}

    # ----------------------------------------------------------------- forward passes
    def _logprobs(self, model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        return logprobs_from_logits(forward_logits(model, ids, mask), ids, self.temperature)

    @torch.no_grad()
    def _recompute_old_logprobs(self, rb: RolloutBatch) -> Tensor:
        parts = [(idx, self._logprobs(self.policy, rb.input_ids[idx], rb.attention_mask[idx]))
                 for idx in self._minibatch_indices(rb)]
        out = torch.zeros_like(rb.input_ids, dtype=parts[0][1].dtype)
        for idx, lp in parts:
            out[idx] = lp
        return out

    def _context(self, mb: RolloutBatch, old: Tensor | None, needs: set[str]) -> StepContext:
        logits = forward_logits(self.policy, mb.input_ids, mb.attention_mask)  # [B, T, V]
        logprobs = logprobs_from_logits(logits, mb.input_ids, self.temperature)  # [B, T]
        provided: dict[str, object] = {}
        if "logits" in needs:
            provided["logits"] = shift_logits(logits)
        if "entropy" in needs or self.entropy_coef > 0:
            provided["entropy"] = entropy_from_logits(logits, self.temperature)
        if needs & _TEACHER:
            provided.update(self._teacher_outputs(mb, logits, needs))
        if "ref_logprobs" in needs:
            with torch.no_grad():
                provided["ref_logprobs"] = self._logprobs(self.reference, mb.input_ids, mb.attention_mask)
        norm_length = self.norm_length if self.norm_length is not None else mb.max_response_length
        return StepContext(
            global_step=self.global_step, logprobs=logprobs,
            old_logprobs=logprobs.detach() if old is None else old,
            aggregation=self.aggregation, norm_length=norm_length, temperature=self.temperature,
            _provided=provided,
            _policy_forward=lambda ids, m: self._logprobs(self.policy, ids, m),
            _reference_forward=(lambda ids, m: self._logprobs(self.reference, ids, m))
            if self.reference is not None else None,
        )

    @torch.no_grad()
    def _teacher_outputs(self, mb: RolloutBatch, student_logits: Tensor, needs: set[str]
                         ) -> dict[str, object]:
        """ONE teacher forward on the hinted contexts, mapped into the student layout.

        Teacher log-probs are taken on the teacher's own sequence, then picked at each student
        token's teacher position; the `[B, T, V]` logits are gathered only when a head reads them.
        """
        B, T = mb.input_ids.shape
        if mb.teacher_input_ids is None:
            out: dict[str, object] = {"teacher_aligned": torch.zeros(B, dtype=torch.bool, device=self.device),
                                      "teacher_logprobs": torch.zeros(B, T, device=self.device)}
            if "teacher_logits" in needs:
                out["teacher_logits"] = torch.zeros_like(student_logits)
            return out
        model = self.teacher if self.teacher is not None else self.policy
        t_logits = forward_logits(model, mb.teacher_input_ids, mb.teacher_attention_mask)  # [B, T', V]
        required = (mb.response_mask & mb.has_teacher.unsqueeze(1)) | mb.sdpo_mask
        aligned = teacher_alignment(mb.input_ids, mb.teacher_input_ids, mb.teacher_positions, required)
        t_lp = logprobs_from_logits(t_logits, mb.teacher_input_ids, self.temperature)  # [B, T']
        lp = t_lp.gather(1, mb.teacher_positions.clamp(min=0))  # [B, T]
        lp = torch.where(mb.teacher_positions >= 1, lp, torch.zeros_like(lp))
        out = {"teacher_aligned": aligned, "teacher_logprobs": lp}
        if "teacher_logits" in needs:
            out["teacher_logits"] = gather_teacher_logits(t_logits, mb.teacher_positions)  # [B, T, V]
        return out

    # ----------------------------------------------------------------- objective
    def _objective(self, mb: RolloutBatch, ctx: StepContext, weights: dict[str, float]
                   ) -> tuple[Tensor, dict[str, Tensor | float]]:
        metrics: dict[str, Tensor | float] = {}
        terms: list[AdvantageTerm] = []
        total = ctx.logprobs.sum() * 0.0
        for head in self.heads:
            w = weights[head.name]
            metrics[f"{head.name}/weight"] = w
            if w == 0.0:  # a zero-weight head is not computed: it cannot touch any gradient
                continue
            out = head.compute(mb, ctx)
            metrics.update({f"{head.name}/{k}": v for k, v in out.metrics.items()})
            if out.advantages is not None:
                active = (out.active_mask if out.active_mask is not None else mb.response_mask).bool()
                terms.append(AdvantageTerm(head.name, w, out.advantages.detach(), active))
                metrics[f"{head.name}/adv_mean"], metrics[f"{head.name}/adv_std"] = masked_stats(
                    out.advantages, active)
            else:
                metrics[f"{head.name}/loss"] = out.loss.detach()
                total = total + w * out.loss
        if terms:
            scales = variance_scales(terms, self.variance_matching)
            scaled = [(t.name, t.weight * scales[t.name] * t.advantages) for t in terms]
            for t in terms:
                metrics[f"{t.name}/weight"] = t.weight * scales[t.name]
            pg, pg_metrics = self._surrogate(ctx, mb, scaled)
            metrics.update({f"ppo/{k}": v for k, v in pg_metrics.items()})
            metrics["ppo/loss"] = pg.detach()
            total = total + pg
        if ctx.has("entropy"):
            ent = ctx.entropy
            metrics["entropy"] = masked_aggregate(ent.detach(), mb.response_mask, "token_mean")
            if self.entropy_coef > 0:
                total = total - self.entropy_coef * ctx.aggregate(ent, mb.response_mask)
        metrics["train/loss"] = total.detach()
        return total, metrics

    def _surrogate(self, ctx: StepContext, mb: RolloutBatch, scaled: list[tuple[str, Tensor]]
                   ) -> tuple[Tensor, dict[str, Tensor]]:
        kw = dict(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                  aggregation=self.aggregation, norm_length=ctx.norm_length)
        mixed = torch.stack([a for _, a in scaled]).sum(0)
        if self.mixing == "advantage":
            return policy_loss(ctx.logprobs, ctx.old_logprobs, mixed, mb.response_mask, **kw)
        loss = sum(policy_loss(ctx.logprobs, ctx.old_logprobs, a, mb.response_mask, **kw)[0]
                   for _, a in scaled)
        with torch.no_grad():
            _, metrics = policy_loss(ctx.logprobs, ctx.old_logprobs, mixed, mb.response_mask, **kw)
        return loss, metrics

    # ----------------------------------------------------------------- the step
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        rb = batch["rollout"] if isinstance(batch, dict) else batch
        if not isinstance(rb, RolloutBatch):
            raise TypeError(f"training_step expects a RolloutBatch (or a dict with key 'rollout'), "
                            f"got {type(rb).__name__}; is the rollout callback configured?")
        opt = self.optimizers()
        updates = self.ppo_epochs * self.minibatches
        old_full = self._recompute_old_logprobs(rb) if updates > 1 else None
        splits = self._minibatch_indices(rb)
        history: dict[str, list[float]] = defaultdict(list)
        first = True
        for _ in range(self.ppo_epochs):
            for idx in splits:
                mb = rb.select(idx)
                weights = {h.name: h.effective_weight(self.global_step) for h in self.heads}
                needs = set().union(*(h.requires for h in self.heads if weights[h.name] > 0))
                ctx = self._context(mb, None if old_full is None else old_full[idx], needs)
                if first:
                    old = ctx.old_logprobs if old_full is None else old_full
                    self._canary(rb, old, history)
                    for head in self.heads:
                        head.on_rollout(rb, old)
                    first = False
                loss, metrics = self._objective(mb, ctx, weights)
                opt.zero_grad()
                self.manual_backward(loss)
                if self.max_grad_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                    metrics["train/grad_norm"] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                opt.step()
                for k, v in metrics.items():
                    history[k].append(float(v))
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        self.policy_version += 1
        self.log_dict({k: sum(v) / len(v) for k, v in history.items()}, on_step=True,
                      batch_size=rb.batch_size)
        self.log("loss", history["train/loss"][-1], prog_bar=True, on_step=True, logger=False,
                 batch_size=rb.batch_size)
        return loss.detach()

    def _canary(self, rb: RolloutBatch, old: Tensor, history: dict[str, list[float]]) -> None:
        """|engine − trainer| log-probs on sampled tokens, before the update."""
        if rb.engine_logprobs is None or not rb.response_mask.any():
            return
        gap = (rb.engine_logprobs.to(old.dtype) - old).abs()[rb.response_mask]
        mean, worst = float(gap.mean()), float(gap.max())
        history["rollout/logprob_gap_mean"].append(mean)
        history["rollout/logprob_gap_max"].append(worst)
        if self.max_logprob_gap is not None and mean > self.max_logprob_gap:
            raise OutOfSyncError(
                f"the engine is out of sync with the trainer: mean |engine - trainer| log-prob gap "
                f"{mean:.4g} > max_logprob_gap={self.max_logprob_gap} (max {worst:.4g}, policy_version "
                f"{rb.policy_version}); the weight push did not reach the engine")

    def _minibatch_indices(self, rb: RolloutBatch) -> list[Tensor]:
        """Split rows into `minibatches` parts along group boundaries (groups never split)."""
        if self.minibatches == 1:
            return [torch.arange(rb.batch_size, device=rb.input_ids.device)]
        groups = torch.unique_consecutive(rb.group_ids)
        if len(torch.unique(rb.group_ids)) != len(groups):
            raise ValueError("minibatches > 1 needs each group's samples to be contiguous in the batch")
        if len(groups) < self.minibatches:
            raise ValueError(f"minibatches={self.minibatches} but the batch has only {len(groups)} groups")
        return [torch.nonzero(torch.isin(rb.group_ids, part)).flatten()
                for part in torch.tensor_split(groups, self.minibatches)]

    # ----------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["composer"] = {"policy_version": self.policy_version,
                                  "heads": {h.name: h.state_dict() for h in self.heads},
                                  "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("composer", {})
        self.policy_version = state.get("policy_version", 0)
        for head in self.heads:
            if head.name in state.get("heads", {}):
                head.load_state_dict(state["heads"][head.name])
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])


def _live_objects(**args: Any) -> list[str]:
    """Arguments to keep out of the checkpoint's hyper-parameters.

    Under LightningCLI the hyper-parameters are the parsed `class_path` config (safe to load with
    `weights_only`, and `load_from_checkpoint` rebuilds from them); built in Python, the heads,
    models and factories are live objects, which are not stored.
    """
    try:
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

        if _given_hyperparameters.get() is not None:
            return []
    except ImportError:  # pragma: no cover - a Lightning without the CLI context
        pass
    return [k for k, v in args.items() if v is not None and not isinstance(v, (str, int, float))]


def _frozen(model: str | nn.Module | None) -> nn.Module | None:
    if model is None:
        return None
    m = load_causal_lm(model)
    m.requires_grad_(False)
    return m.eval()


def _check_heads(heads: list[Head]) -> nn.ModuleList | list[Head]:
    if not heads:
        raise ValueError("ComposerModule needs at least one head")
    for h in heads:
        if not isinstance(h, Head):
            raise TypeError(f"heads must be Head instances, got {type(h).__name__}: {h!r}")
    names = [h.name for h in heads]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate head names {dupes}: give each head a unique `name`")
    return list(heads)


def _check_settings(clip_low: float, clip_high: float, dual_clip: float | None, aggregation: str,
                    norm_length: int | None, entropy_coef: float, temperature: float, mixing: str,
                    ppo_epochs: int, minibatches: int, max_grad_norm: float | None,
                    max_logprob_gap: float | None) -> None:
    # The objective's own validation (clip values, aggregation names) runs on a 1-token dummy.
    one = torch.zeros(1, 1)
    policy_loss(one, one, one, torch.ones(1, 1, dtype=torch.bool), clip_low=clip_low,
                clip_high=clip_high, dual_clip=dual_clip, aggregation=aggregation,
                norm_length=norm_length if norm_length is not None else 1)
    if norm_length is not None and norm_length < 1:
        raise ValueError(f"norm_length must be >= 1 or None, got {norm_length}")
    if mixing not in _MIXINGS:
        raise ValueError(f"mixing must be one of {_MIXINGS}, got {mixing!r}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not (entropy_coef >= 0 and math.isfinite(entropy_coef)):
        raise ValueError(f"entropy_coef must be finite and >= 0, got {entropy_coef}")
    for name, v in (("ppo_epochs", ppo_epochs), ("minibatches", minibatches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    for name, v in (("max_grad_norm", max_grad_norm), ("max_logprob_gap", max_logprob_gap)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0 or None, got {v}")

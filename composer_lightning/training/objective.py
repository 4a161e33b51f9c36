"""The objective of one minibatch: heads in, `(loss, metrics)` out.

`A = Σ w_i · advantages_i` over the advantage heads (optionally variance-matched) goes through
ONE clipped surrogate (`mixing="advantage"`), or each weighted term through its own surrogate,
summed (`mixing="loss"`, OpenClaw's "scheme A", for ablations); then `+ Σ w_j · loss_j` over
the loss heads and `− entropy_coef · aggregate(H)`. The loop around it (forwards, updates,
logging) lives in `ComposerModule`; this is the seam tests and other trainers call.

Each head's share of the gradient is measured at the policy's final hidden states
(`functional/gradients.py`) from its piece of the loss: `w_j · loss_j` for a loss head, the
clipped surrogate of its own weighted term `w_i · A_i` alone for an advantage head (what
`mixing="loss"` sums). Under `mixing="loss"` the pieces sum to the loss exactly; under
`mixing="advantage"` their gradients sum to the mixed surrogate's wherever no clip binds (ratio
in the clip range: always on the first update of an on-policy batch, where it is 1), since the
surrogate is then linear in A. The entropy bonus is not a head and is in no piece.

Why this file is long: `Objective` is the public seam of the loss, and its nineteen options
(the surrogate's, the mixing's, the entropy bonus's) are documented on it, as `ComposerModule`
passes them through.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, cast

import torch
from torch import Tensor

from composer_lightning.functional import (
    masked_aggregate,
    policy_loss,
    truncated_importance_weights,
)
from composer_lightning.functional.gradients import (
    gradient_gram,
    gradient_shares,
    hidden_gradients,
    scaled_gram,
)
from composer_lightning.functional.policy import AGGREGATION_MODES
from composer_lightning.heads.base import HINTED_SIGNALS, TEACHER_SIGNALS, Head, HeadOutput
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext
from composer_lightning.runtime.distributed import StepMetrics, agree, world
from composer_lightning.training.entropy import AdaptiveEntropy, EntropyControl
from composer_lightning.training.mixer import (
    AdvantageTerm,
    grad_norm_scales,
    masked_stats,
    teacher_cap_scales,
    variance_scales,
)
from composer_lightning.training.surrogate import (
    check_surrogate,
    entropy_tokens,
    kept_share,
    off_policy_tokens,
)

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]
Mixing = Literal["advantage", "loss"]
LossMode = Literal["clip", "cispo", "sapo"]
RatioLevel = Literal["token", "sequence", "sequence_token"]


class Objective:
    """The composed loss of one minibatch.

    The surrogate's options and masks act on the advantage heads' one surrogate; loss heads
    (SDPO, replay DPO, top-k OPD, KL in the loss) keep their own losses unchanged.

    Args:
        heads: the loss heads (unique names).
        clip_low: PPO ε_low in (0, 1).
        clip_high: PPO ε_high > 0.
        dual_clip: dual-clip c > 1 for A < 0, or None.
        aggregation: how per-token losses are reduced (see `functional.masked_aggregate`).
        entropy_coef: entropy bonus coefficient (≥ 0).
        mixing: `advantage` (one surrogate on the mixed advantage) or `loss` (one per term).
        variance_matching: name of a reference advantage head, or None.
        grad_norm_matching: name of a reference head (of either kind), or None: every head's
            weight is multiplied by ‖ĝ_ref‖ / ‖ĝ_h‖, the norms of the unweighted pieces'
            gradients at the final hidden states on this minibatch (over all ranks; detached;
            a head or reference with a zero gradient keeps its weight), so head h's gradient
            norm is `w_h / w_ref` times the reference's (`mixer.py`); measured before the loss
            is formed: one backward through the chunked LM head per head, every step.
            Exclusive with `variance_matching`.
        teacher_cap: a head that reads a hinted teacher (OPD, top-k OPD, SDPO) or imitates the
            hinted context's replies (context distillation) pulls on the policy at most
            `teacher_cap` (default 0.2) times as hard as the other heads together (the RL
            signal): each minibatch its weight is scaled by `min(1, teacher_cap · ‖g_rest‖ /
            ‖g_h‖)`, the norms of the weighted pieces' gradients at the final hidden states
            (over all ranks, detached; `mixer.teacher_cap_scales`), logged as `<head>/weight`.
            Where the rest has no gradient (no group with both a right and a wrong reply) the
            teacher's weight is scaled by `teacher_alone` (default 0.2; 0: a teacher never
            leads alone). Uncapped, on SmolLM2 OPD x1 with the answer as the hint took
            held-out accuracy from 0.234 to 0 in 10 steps, its token noise setting Adam's
            direction where RL's signal was one right reply in 32.
            Costs one backward through the chunked LM head per head on the steps a teacher
            head reads. Applies when both a teacher head and another head have a non-zero
            weight and neither matching option is set; None: uncapped.
        teacher_alone: the teacher heads' weight scale, in [0, 1], on a minibatch where the
            other heads have no gradient (under `teacher_cap`; see there).
        importance_cap: for a stale batch (`ctx.behavior_logprobs` set), the surrogate's
            per-token loss is weighted by `min(exp(old − behaviour), importance_cap)`
            (truncated importance sampling, verl's `rollout_is_threshold`); None: no weights.
            Loss heads (SDPO, DPO) are not reweighted.
        loss_mode: the surrogate (`functional.policy_loss`): `clip` (PPO), `cispo` (the ratio
            capped at 1 + clip_high as a detached weight on log π) or `sapo` (a soft gate).
        importance_sampling_level: `token`, `sequence` (GSPO: one ratio per response) or
            `sequence_token` (GSPO-token). `sequence` is refused with a head whose advantages
            differ along a response (`Head.per_token_advantages`: OPD, KL in the advantage).
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures (A > 0, A ≤ 0).
        top_entropy_quantile: the surrogate keeps only the response tokens in the top share of
            entropy over the minibatch of every rank (`functional.high_entropy_mask`); 1 (default):
            every token. The entropy bonus then acts on the same tokens.
        adaptive_entropy: Skywork-OR1's controller of the entropy bonus's coefficient
            (`training/entropy.py`), starting from `entropy_coef`; None: a fixed coefficient.
        off_policy_mask_threshold: drop negative-advantage tokens of responses whose mean
            `log μ − log π` exceeds it, μ the engine's log-probs when the batch has them, else
            π_old (`functional.off_policy_sequence_mask`); None: no mask.
    """

    def __init__(
        self,
        heads: list[Head],
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        aggregation: Aggregation = "token_sum_norm",
        entropy_coef: float = 0.0,
        mixing: Mixing = "advantage",
        variance_matching: str | None = None,
        importance_cap: float | None = 2.0,
        grad_norm_matching: str | None = None,
        teacher_cap: float | None = 0.2,
        teacher_alone: float = 0.2,
        loss_mode: LossMode = "clip",
        importance_sampling_level: RatioLevel = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: float | None = None,
        adaptive_entropy: AdaptiveEntropy | None = None,
    ):
        self.heads = _check_heads(heads)
        check_surrogate(
            self.heads,
            loss_mode,
            importance_sampling_level,
            dual_clip,
            (sapo_temperature_pos, sapo_temperature_neg),
            top_entropy_quantile,
            off_policy_mask_threshold,
        )
        self.loss_mode, self.ratio_level = loss_mode, importance_sampling_level
        self.sapo_temperatures = (float(sapo_temperature_pos), float(sapo_temperature_neg))
        self.top_entropy_quantile = float(top_entropy_quantile)
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.entropy_control = (
            None if adaptive_entropy is None else EntropyControl(adaptive_entropy, entropy_coef)
        )
        self._entropy_window: tuple[float, float] = (0.0, 0.0)
        if not 0 < clip_low < 1:
            raise ValueError(f"clip_low must be in (0, 1), got {clip_low}")
        if not clip_high > 0:
            raise ValueError(f"clip_high must be > 0, got {clip_high}")
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
        if aggregation not in AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")
        if mixing not in ("advantage", "loss"):
            raise ValueError(f"mixing must be one of ('advantage', 'loss'), got {mixing!r}")
        if not (entropy_coef >= 0 and math.isfinite(entropy_coef)):
            raise ValueError(f"entropy_coef must be finite and >= 0, got {entropy_coef}")
        names = [h.name for h in self.heads]
        if variance_matching is not None and variance_matching not in names:
            raise ValueError(
                f"variance_matching names head {variance_matching!r}, which is not "
                f"among the heads {names}"
            )
        if variance_matching is not None and grad_norm_matching is not None:
            raise ValueError("variance_matching and grad_norm_matching exclude each other: set one")
        if grad_norm_matching is not None and grad_norm_matching not in names:
            raise ValueError(
                f"grad_norm_matching names head {grad_norm_matching!r}, which is not "
                f"among the heads {names}"
            )
        self.grad_norm_matching = grad_norm_matching
        if teacher_cap is not None and (
            isinstance(teacher_cap, bool) or not (math.isfinite(teacher_cap) and teacher_cap >= 0)
        ):
            raise ValueError(
                f"teacher_cap must be a finite number >= 0 or None, got {teacher_cap!r}"
            )
        self.teacher_cap = teacher_cap
        if isinstance(teacher_alone, bool) or not (
            isinstance(teacher_alone, int | float)
            and math.isfinite(teacher_alone)
            and 0 <= teacher_alone <= 1
        ):
            raise ValueError(f"teacher_alone must be a number in [0, 1], got {teacher_alone!r}")
        self.teacher_alone = float(teacher_alone)
        # capped by `teacher_cap`: the heads a hint speaks through (context distillation too)
        self.teachers = {h.name for h in self.heads if h.requires & HINTED_SIGNALS}
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.aggregation, self.entropy_coef = aggregation, entropy_coef
        if importance_cap is not None and not importance_cap >= 1:
            raise ValueError(f"importance_cap must be >= 1 or None, got {importance_cap}")
        self.mixing, self.variance_matching = mixing, variance_matching
        self.importance_cap = importance_cap
        #: called as `observe(batch, ctx, outputs, weights)` with each minibatch's head outputs
        #: and effective weights (the run report's per-token details, `report/tokens.py`);
        #: empty unless something asks, so the step pays nothing for it
        self.observers: list[Callable[..., None]] = []

    def weights(self, step: int) -> dict[str, float]:
        """Every head's effective weight at optimizer step `step`."""
        return {h.name: h.effective_weight(step) for h in self.heads}

    def requirements(self, weights: dict[str, float]) -> set[str]:
        """What the heads with a non-zero weight read from the step context."""
        needs = set().union(*(h.requires for h in self.heads if weights[h.name] > 0))
        reads_entropy = (
            self.entropy_coef > 0
            or self.top_entropy_quantile < 1
            or self.entropy_control is not None
        )
        return needs | ({"entropy"} if reads_entropy else set())

    def reads_teacher(self, step: int | None = None, updates: int = 1) -> bool:
        """Whether a head that reads a hinted teacher (OPD, SDPO, top-k OPD) has a non-zero
        weight: its configured weight, or with `step` its effective weight at any of the
        `updates` optimizer steps from `step` (a ramp that has reached 0 reads no teacher).
        If none does, the rollout side asks no hint provider for hints."""
        return self.reads(TEACHER_SIGNALS, step, updates)

    def reads(self, signals: frozenset[str], step: int | None = None, updates: int = 1) -> bool:
        """Whether a head that requires one of `signals` has a non-zero weight: its configured
        weight, or with `step` its effective weight at any of the `updates` optimizer steps
        from `step`."""
        readers = [h for h in self.heads if h.requires & signals]
        if step is None:
            return any(h.weight > 0 for h in readers)
        return any(h.effective_weight(step + k) > 0 for h in readers for k in range(updates))

    def topk(self) -> int:
        """The largest top-k any head with a non-zero configured weight reads (0: none)."""
        return max((h.topk for h in self.heads if h.weight > 0), default=0)

    def requirements_over(self, step: int, updates: int) -> set[str]:
        """What the heads read over the `updates` optimizer steps starting at `step`."""
        return set().union(*(self.requirements(self.weights(step + k)) for k in range(updates)))

    def caps_teachers(self, weights: dict[str, float]) -> bool:
        """Whether `teacher_cap` applies at these weights (the same on every rank: it measures
        gradients, a collective)."""
        if self.teacher_cap is None or self.grad_norm_matching or self.variance_matching:
            return False
        on = {name for name, w in weights.items() if w != 0.0}
        return bool(on & self.teachers) and bool(on - self.teachers)

    def measures_gradients(self, weights: dict[str, float]) -> bool:
        """Whether every step at these weights measures the heads' gradients (grad-norm
        matching, the teacher cap): the step must keep the policy's final hidden states."""
        return self.grad_norm_matching is not None or self.caps_teachers(weights)

    def head_outputs(
        self, batch: RolloutBatch, ctx: StepContext, weights: dict[str, float]
    ) -> dict[str, HeadOutput]:
        """Each non-zero-weight head's output (a zero-weight head is not computed at all, so it
        cannot touch any gradient)."""
        return {h.name: h.compute(batch, ctx) for h in self.heads if weights[h.name] != 0.0}

    def advantage_terms(
        self, batch: RolloutBatch, outputs: dict[str, HeadOutput], weights: dict[str, float]
    ) -> list[AdvantageTerm]:
        """One term per advantage head; its `weight` is the effective one (variance-matched)."""
        terms = [
            AdvantageTerm(
                name,
                weights[name],
                out.advantages.detach(),
                (out.active_mask if out.active_mask is not None else batch.response_mask).bool(),
            )
            for name, out in outputs.items()
            if out.advantages is not None
        ]
        scales = variance_scales(terms, self.variance_matching)
        return [t._replace(weight=t.weight * scales[t.name]) for t in terms]

    def __call__(
        self,
        batch: RolloutBatch,
        ctx: StepContext,
        weights: dict[str, float],
        *,
        measure_gradients: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The minibatch loss and its metrics (`<head>/<metric>`, `ppo/…`, `train/loss`).

        With `measure_gradients` (and always with `grad_norm_matching`) also `<head>/grad_norm`
        and `<head>/grad_share` (`functional/gradients.py`), measured at `ctx.policy_states()`
        over every rank: a collective, so every rank must pass the same flag."""
        outputs = self.head_outputs(batch, ctx, weights)
        metrics: dict[str, Tensor | float] = {f"{name}/weight": w for name, w in weights.items()}
        total = ctx.logprobs.sum() * 0.0
        for name, out in outputs.items():
            metrics.update({f"{name}/{k}": v for k, v in out.metrics.items()})
            if out.advantages is not None:
                active = out.active_mask if out.active_mask is not None else batch.response_mask
                metrics[f"{name}/adv_mean"], metrics[f"{name}/adv_std"] = masked_stats(
                    out.advantages, active.bool()
                )
            else:
                assert out.loss is not None  # HeadOutput holds exactly one of the two
                metrics[f"{name}/loss"] = out.loss.detach()
        terms = self.advantage_terms(batch, outputs, weights)
        effective = {name: weights[name] for name in outputs} | {t.name: t.weight for t in terms}
        if measure_gradients or self.measures_gradients(weights):
            names = list(effective)
            gram = self.gradient_gram(batch, ctx, outputs, effective)
            scales = None
            if self.grad_norm_matching is not None:
                # the unweighted pieces' norms (a computed head's weight is > 0)
                unit = {n: float(gram[h, h]) / effective[n] ** 2 for h, n in enumerate(names)}
                scales = grad_norm_scales(unit, self.grad_norm_matching)
            elif self.teacher_cap is not None and self.caps_teachers(weights):
                scales = teacher_cap_scales(
                    gram, names, self.teachers, self.teacher_cap, self.teacher_alone
                )
                metrics.update({f"{n}/cap_scale": scales[n] for n in names if n in self.teachers})
            if scales is not None:
                effective = {n: w * scales[n] for n, w in effective.items()}
                gram = scaled_gram(
                    gram, torch.tensor([scales[n] for n in names], dtype=torch.float64)
                )
            metrics.update(gradient_shares(gram, names))
        metrics.update({f"{name}/weight": w for name, w in effective.items()})
        for observe in self.observers:
            observe(batch, ctx, outputs, effective)
        for name, out in outputs.items():
            if out.loss is not None:
                total = total + effective[name] * out.loss
        terms = [t._replace(weight=effective[t.name]) for t in terms]
        # the high-entropy tokens, once (a collective): the surrogate and the bonus share them
        kept = self._entropy_kept(ctx, batch)
        bonus_tokens = batch.response_mask if kept is None else kept
        if terms:
            pg, pg_metrics = self.surrogate(ctx, batch, terms, kept)
            metrics.update({f"ppo/{k}": v for k, v in pg_metrics.items()})
            metrics["ppo/loss"] = pg.detach()
            total = total + pg
        if ctx.has("entropy"):
            metrics["entropy"] = masked_aggregate(
                ctx.entropy.detach(), batch.response_mask, "token_mean"
            )
            control = self.entropy_control
            coef = self.entropy_coef if control is None else control.applied()
            if coef > 0 or control is not None:  # on the tokens the surrogate trains
                total = total - coef * ctx.aggregate(ctx.entropy, bonus_tokens)
            if control is not None:  # measured for the controller's update (`end_step`)
                held = ctx.entropy.detach()[bonus_tokens]
                self._entropy_window = (float(held.sum()), float(held.numel()))
                metrics["entropy_coef"] = coef
        metrics["train/loss"] = total.detach()
        return total, metrics

    def end_step(self) -> None:
        """After an optimizer step: the adaptive entropy controller's update from the mean
        entropy of the bonus tokens over every rank (a collective when adaptive entropy is on:
        every rank calls it after every step)."""
        if self.entropy_control is None:
            return
        local = StepMetrics()
        local.sum("sum", self._entropy_window[0])
        local.sum("count", self._entropy_window[1])
        reduced = agree(local)
        self.entropy_control.update(reduced["sum"] / max(reduced["count"], 1.0))

    def pieces(
        self,
        batch: RolloutBatch,
        ctx: StepContext,
        outputs: dict[str, HeadOutput],
        weights: dict[str, float],
    ) -> dict[str, Tensor]:
        """Each head's piece of the loss at its effective weight in `weights`: `w · loss` for a
        loss head, the clipped surrogate of `w · A` alone for an advantage head (importance-
        weighted as the loss is). They sum to the loss's gradient but for the entropy bonus,
        exactly under `mixing="loss"` and wherever no clip binds under `"advantage"`."""
        kw, _ = self._surrogate_options(ctx, batch)
        out = {}
        for name, head in outputs.items():
            if head.loss is not None:
                out[name] = weights[name] * head.loss
            else:
                assert head.advantages is not None  # HeadOutput holds exactly one of the two
                scaled = weights[name] * head.advantages.detach()
                out[name] = policy_loss(
                    ctx.logprobs, ctx.old_logprobs, scaled, batch.response_mask, **kw
                )[0]
        return out

    def gradient_gram(
        self,
        batch: RolloutBatch,
        ctx: StepContext,
        outputs: dict[str, HeadOutput],
        weights: dict[str, float],
    ) -> Tensor:
        """`[H, H]` the Gram matrix of the pieces' gradients at the policy's final hidden
        states (in the order of `weights`), of the ranks' mean objective (DDP and FSDP2 average
        the ranks' gradients: the states of rank r get `g_r / N`): `Σ_r G_r / N²`, summed in
        one `agree`, a collective."""
        pieces = self.pieces(batch, ctx, outputs, weights)
        gram = gradient_gram(hidden_gradients(pieces, ctx.policy_states()))
        _, size = world()
        if size == 1:
            return gram
        local = StepMetrics()
        for i in range(len(gram)):
            for j in range(len(gram)):
                local.sum(f"{i},{j}", gram[i, j])
        summed = agree(local)
        return torch.tensor(
            [[summed[f"{i},{j}"] for j in range(len(gram))] for i in range(len(gram))],
            dtype=torch.float64,
        ) / (size * size)

    def _entropy_kept(self, ctx: StepContext, batch: RolloutBatch) -> Tensor | None:
        """`[B, T]` bool, the tokens `top_entropy_quantile` keeps (a collective); None: all."""
        if self.top_entropy_quantile == 1:
            return None
        return entropy_tokens(ctx, batch, self.top_entropy_quantile)

    def _surrogate_options(
        self, ctx: StepContext, batch: RolloutBatch, kept: Tensor | None = None
    ) -> tuple[dict, dict[str, Tensor]]:
        """`policy_loss`'s options for this minibatch, and the importance weights' metrics;
        `kept`: the high-entropy tokens when the caller has them already."""
        weights, is_metrics = self.importance_weights(ctx, batch)
        if kept is None:
            kept = self._entropy_kept(ctx, batch)
        if kept is not None:
            share = kept_share(kept, batch.response_mask)
            kept = kept.to(ctx.logprobs.dtype)
            weights = kept if weights is None else weights * kept
            is_metrics = is_metrics | {"entropy_kept": share}
        kw = dict(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            aggregation=self.aggregation,
            norm_length=ctx.norm_length,
            weights=weights,
            loss_mode=self.loss_mode,
            ratio_level=self.ratio_level,
            sapo_temperatures=self.sapo_temperatures,
        )
        return kw, is_metrics

    def surrogate(
        self,
        ctx: StepContext,
        batch: RolloutBatch,
        terms: list[AdvantageTerm],
        kept: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate of the weighted advantage terms, per `mixing`; `kept`: the
        high-entropy tokens when the caller has them already."""
        kw, is_metrics = self._surrogate_options(ctx, batch, kept)
        scaled = [t.weight * t.advantages for t in terms]
        mixed = torch.stack(scaled).sum(0)  # [B, T]
        if self.off_policy_mask_threshold is not None:
            kept = off_policy_tokens(ctx, batch, mixed, self.off_policy_mask_threshold)
            kw["weights"] = kept if kw["weights"] is None else kw["weights"] * kept
            is_metrics = is_metrics | {"off_policy_kept": kept_share(kept, batch.response_mask)}
        if self.mixing == "advantage":
            loss, metrics = policy_loss(
                ctx.logprobs, ctx.old_logprobs, mixed, batch.response_mask, **kw
            )
        else:
            loss = cast(  # a tensor: `scaled` is never empty (stacked above)
                Tensor,
                sum(
                    policy_loss(ctx.logprobs, ctx.old_logprobs, a, batch.response_mask, **kw)[0]
                    for a in scaled
                ),
            )
            with torch.no_grad():
                _, metrics = policy_loss(
                    ctx.logprobs, ctx.old_logprobs, mixed, batch.response_mask, **kw
                )
        return loss, metrics | {f"is_{k}": v for k, v in is_metrics.items()}

    def importance_weights(
        self, ctx: StepContext, batch: RolloutBatch
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """The truncated importance weights of a stale batch (None on policy)."""
        if ctx.behavior_logprobs is None or self.importance_cap is None:
            return None, {}
        return truncated_importance_weights(
            ctx.old_logprobs, ctx.behavior_logprobs, batch.response_mask, self.importance_cap
        )


def _check_heads(heads: list[Head]) -> list[Head]:
    if not heads:
        raise ValueError("the objective needs at least one head")
    for h in heads:
        if not isinstance(h, Head):
            raise TypeError(f"heads must be Head instances, got {type(h).__name__}: {h!r}")
    names = [h.name for h in heads]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate head names {dupes}: give each head a unique `name`")
    return list(heads)

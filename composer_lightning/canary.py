"""The canary: does the engine still sample from the trainer's weights?

Before the first update of a rollout batch, |engine − trainer| log-probs of the sampled tokens,
the trainer's taken at the version that generated the batch: the current weights on policy, or
for a stale batch (overlapped generation) a recompute with that version's published weights
(`RolloutBatch.behavior_logprobs`). After a correct push the mean gap is ≈1e-6 in fp32 on CPU
(≈1e-2 in bf16 on GPUs); an engine that missed one push after a step at lr 1e-4 shows
0.009–0.03, a long-stale one ≈0.2. The default threshold follows the precision
(`default_max_logprob_gap`), so a lost push stops the run at the next step. The gap is reduced
over ranks: a rank whose engine is out of sync stops every rank in the same step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from composer_lightning.batch import RolloutBatch
from composer_lightning.distributed import StepMetrics, agree
from composer_lightning.engines.weights import hf_name
from composer_lightning.forward import score_tokens

__all__ = ["OutOfSyncError", "check_canary", "default_max_logprob_gap", "version_logprobs"]

FULL_PRECISION = ("32-true", "32", "64-true", "64")


def default_max_logprob_gap(trainer_precision: str, engine_dtype: str | None) -> float:
    """1e-3 when both sides compute in fp32 or fp64 (a healthy mean gap is ≈1e-6), else 0.05
    (bf16/fp16 on either side: a healthy mean gap is ≈1e-2)."""
    full = str(trainer_precision) in FULL_PRECISION and engine_dtype in ("float32", "float64")
    return 1e-3 if full else 0.05


class OutOfSyncError(RuntimeError):
    """The engine's log-probs disagree with the trainer's: the weight push is broken."""


def check_canary(
    rb: RolloutBatch, old: Tensor, max_logprob_gap: float | None, stale: bool = False
) -> StepMetrics:
    """|engine − trainer| log-probs on sampled tokens, before the update, over all ranks: a
    rank whose engine is out of sync stops every rank in the same step.

    `old` are the trainer's log-probs at its current version; a `stale` batch is compared with
    its `behavior_logprobs` (the generating version's, finite on the rows recomputed) instead,
    and not at all without them (the first batches after a resume with overlap)."""
    metrics = StepMetrics()
    trainer, covered = old, rb.response_mask
    if stale:
        trainer = rb.behavior_logprobs
        if trainer is not None:
            covered = covered & torch.isfinite(trainer)
    if rb.engine_logprobs is not None and trainer is not None:
        gap = (rb.engine_logprobs.to(old.dtype) - trainer.to(old.dtype)).abs()[covered]
        n = gap.numel()
        metrics.mean("rollout/logprob_gap_mean", gap.mean() if n else 0.0, weight=n)
        metrics.max("rollout/logprob_gap_max", gap.max() if n else 0.0)
        metrics.max("rollout/logprob_gap_worst_rank", gap.mean() if n else 0.0)
    reduced = agree(metrics)  # every rank, every step: the same collectives whatever the data
    if "rollout/logprob_gap_worst_rank" not in reduced:
        return StepMetrics()
    worst_rank = reduced["rollout/logprob_gap_worst_rank"]
    if max_logprob_gap is not None and worst_rank > max_logprob_gap:
        raise OutOfSyncError(
            f"the engine is out of sync with the trainer: mean |engine - trainer| log-prob gap "
            f"{worst_rank:.4g} > max_logprob_gap={max_logprob_gap} (max "
            f"{reduced['rollout/logprob_gap_max']:.4g}, policy_version {rb.policy_version}); "
            "the weight push did not reach the engine"
        )
    out = StepMetrics()
    out.mean("rollout/logprob_gap_mean", reduced["rollout/logprob_gap_mean"])
    out.max("rollout/logprob_gap_max", reduced["rollout/logprob_gap_max"])
    out.max("rollout/logprob_gap_worst_rank", worst_rank)  # the mean of the worst rank
    return out


#: Rows of a stale batch whose log-probs are recomputed at the generating version: enough to
#: see a lost push (every token of every row moves), cheap next to the update.
CANARY_ROWS = 2


class _Scoring(nn.Module):
    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, rb: RolloutBatch, temperature: float, chunk_size: int | None) -> Tensor:
        return score_tokens(
            self.policy,
            rb.input_ids,
            rb.attention_mask,
            temperature=temperature,
            mask=rb.response_mask,
            chunk_size=chunk_size,
        ).logprobs


@torch.no_grad()
def version_logprobs(
    policy: nn.Module,
    weights: dict[str, Tensor],
    rb: RolloutBatch,
    temperature: float,
    chunk_size: int | None,
    rows: int = CANARY_ROWS,
) -> Tensor | None:
    """`[B, T]` log-probs of the sampled tokens under `weights` (a published version of
    `policy`, by parameter name) on the first `rows` rows, NaN elsewhere; None when the names
    are not the policy's own (a wrapped or sharded policy)."""
    names = [n for n, _ in policy.named_parameters(remove_duplicate=False)]
    if set(names) != set(weights) or any(hf_name(n) != n for n in names):
        return None
    head = rb.select(torch.arange(min(rows, rb.batch_size), device=rb.input_ids.device))
    values = {f"policy.{n}": weights[n].to(rb.input_ids.device) for n in names}
    lp = functional_call(
        _Scoring(policy), values, (head, temperature, chunk_size), tie_weights=False
    )
    out = torch.full(rb.input_ids.shape, float("nan"), dtype=lp.dtype, device=lp.device)
    out[: head.batch_size] = lp
    return out

"""The canary: does the engine still sample from the trainer's weights?

Before the first update of a rollout batch, |engine − trainer| log-probs of the sampled tokens.
After a correct push this is ≈1e-6 in fp32 on CPU (≈1e-2 in bf16 on GPUs); a stale engine
shows ≈0.2. The gap is reduced over ranks: a rank whose engine is out of sync stops every rank
in the same step.
"""

from __future__ import annotations

from torch import Tensor

from composer_lightning.batch import RolloutBatch
from composer_lightning.distributed import StepMetrics, agree

__all__ = ["OutOfSyncError", "check_canary"]


class OutOfSyncError(RuntimeError):
    """The engine's log-probs disagree with the trainer's: the weight push is broken."""


def check_canary(rb: RolloutBatch, old: Tensor, max_logprob_gap: float | None) -> StepMetrics:
    """|engine − trainer| log-probs on sampled tokens, before the update, over all ranks: a
    rank whose engine is out of sync stops every rank in the same step."""
    metrics = StepMetrics()
    if rb.engine_logprobs is not None:
        gap = (rb.engine_logprobs.to(old.dtype) - old).abs()[rb.response_mask]
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

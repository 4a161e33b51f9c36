"""The canary: does the engine still sample from the trainer's weights?

Before the first update of a rollout batch, |engine − trainer| log-probs of the sampled tokens,
the trainer's taken at the version that generated the batch: the current weights on policy, or
for a stale batch (overlapped generation) a recompute with that version's published weights
(`RolloutBatch.behavior_logprobs`). After a correct push the mean gap is ≈1e-6 in fp32 on CPU
(0.03–0.07 on SmolLM2 with bf16 on either side); in fp32 an engine that missed one push after
a step at lr 1e-4 shows 0.009–0.03, a long-stale one ≈0.2. The default threshold follows the
precision (`default_max_logprob_gap`), so in fp32 a lost push stops the run at the next step.
The gap is reduced over ranks: a rank whose engine is out of sync stops every rank in the same
step. A NaN or inf where the canary looks (log-probs on either side) stops the run the same way.

Beside the gap, the engine's weight fingerprint for the version that generated the batch is
compared with the trainer's, exactly (`engines/fingerprint.py`): that sees one lost push at any
precision, where the gap cannot in bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
from torch import Tensor, nn

from composer_lightning.engines.fingerprint import Fingerprint, fingerprint_mismatches
from composer_lightning.models.weights import hf_name
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.runtime.distributed import StepMetrics, agree
from composer_lightning.training.forward import response_logprobs

__all__ = [
    "CANARY_METRICS",
    "OutOfSyncError",
    "check_canary",
    "check_fingerprint",
    "default_max_logprob_gap",
    "nonfinite_loss",
    "version_logprobs",
]

#: The canary's figures; a step that compares nothing logs none of them (not the last ones).
CANARY_METRICS = (
    "rollout/logprob_gap_mean",
    "rollout/logprob_gap_max",
    "rollout/logprob_gap_worst_rank",
)

FULL_PRECISION = ("32-true", "32", "64-true", "64")


def default_max_logprob_gap(trainer_precision: str, engine_dtype: str | None) -> float:
    """1e-3 when both sides compute in fp32 or fp64 (a healthy mean gap is ≈1e-6), else 0.2.

    With bf16 on either side the healthy gap grows with the model: ≈2e-3 on the tiny policy,
    and on SmolLM2-135M (`bench/precision_gap.py`, 4 steps) a worst per-step mean of 0.065
    (engine fp32, trainer bf16-mixed), 0.054 (engine bf16, trainer fp32) and 0.036 (both bf16),
    over the 0.05 this default was before. 0.2 leaves 3× or more; a lost push in bf16 is the
    weight fingerprint's to see (`check_fingerprint`), not the gap's."""
    full = str(trainer_precision) in FULL_PRECISION and engine_dtype in ("float32", "float64")
    return 1e-3 if full else 0.2


class OutOfSyncError(RuntimeError):
    """The engine's log-probs disagree with the trainer's: the weight push is broken."""


def check_canary(
    rb: RolloutBatch, old: Tensor, max_logprob_gap: float | None, stale: bool = False
) -> StepMetrics:
    """|engine − trainer| log-probs on sampled tokens, before the update, over all ranks: a
    rank whose engine is out of sync stops every rank in the same step.

    `old` are the trainer's log-probs at its current version; a `stale` batch is compared with
    its `behavior_logprobs` (the generating version's, recomputed on the first `CANARY_ROWS`
    rows) instead; without them, on its `on_policy_rows` (rows the current weights sampled, in
    a batch of mixed versions: serve's) against `old`; else not at all (batches generated
    before a resume). A batch of
    a shaped sampler (`rb.sampler_shaped`: top-k, min-p, penalties) is not compared: its
    log-probs differ from the trainer's by design; the weight fingerprint (`check_fingerprint`)
    still checks the push.

    Raises:
        OutOfSyncError: on every rank, when a rank's gap is over `max_logprob_gap` or not
            finite."""
    metrics = StepMetrics()
    trainer: Tensor | None
    trainer, covered = old, rb.response_mask
    if stale:
        trainer = rb.behavior_logprobs
        if trainer is not None:  # the first rows were recomputed (`version_logprobs`)
            rows = torch.arange(rb.batch_size, device=covered.device) < CANARY_ROWS
            covered = covered & rows[:, None]
        elif rb.on_policy_rows is not None and bool(rb.on_policy_rows.any()):
            # rows of these very weights, among older ones
            trainer, covered = old, covered & rb.on_policy_rows.to(covered.device)[:, None]
    if rb.sampler_shaped:
        trainer = None
    error = None
    if rb.engine_logprobs is not None and trainer is not None:
        engine = rb.engine_logprobs.to(old.dtype)[covered]
        gap = (engine - trainer.to(old.dtype)[covered]).abs()
        n = gap.numel()
        if n and not bool(torch.isfinite(gap).all()):
            side = "engine" if not bool(torch.isfinite(engine).all()) else "trainer"
            error = OutOfSyncError(
                f"non-finite {side} log-probs on {int((~torch.isfinite(gap)).sum())} of {n} "
                f"sampled tokens (policy_version {rb.policy_version}): the weights are broken "
                "(NaN or inf), or the engine does not sample from them"
            )
        else:
            metrics.mean("rollout/logprob_gap_mean", gap.mean() if n else 0.0, weight=n)
            metrics.max("rollout/logprob_gap_max", gap.max() if n else 0.0)
            metrics.max("rollout/logprob_gap_worst_rank", gap.mean() if n else 0.0)
    # every rank, every step: the same collectives whatever the data
    reduced = agree(metrics, error=error)
    if "rollout/logprob_gap_worst_rank" not in reduced:
        return StepMetrics()
    worst_rank = reduced["rollout/logprob_gap_worst_rank"]
    if max_logprob_gap is not None and not worst_rank <= max_logprob_gap:
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


def nonfinite_loss(loss: Tensor, version: int) -> OutOfSyncError | None:
    """The error for a NaN or inf minibatch loss (broken weights or log-probs), else None."""
    if bool(torch.isfinite(loss)):
        return None
    return OutOfSyncError(
        f"non-finite loss {float(loss)} at policy_version {version}: the weights or the "
        "rollout's log-probs are broken (NaN or inf); stopping before the update"
    )


def check_fingerprint(trainer: Fingerprint | None, engine: Fingerprint | None, version: int) -> int:
    """Compare the engine's weight fingerprint of `version` with the trainer's, exactly (up to
    the order of summation); returns how many parameters were compared (0: nothing to compare,
    e.g. an engine that cannot read its weights back).

    Raises:
        OutOfSyncError: a parameter's sum differs: the engine does not hold `version`.
    """
    if trainer is None or engine is None:
        return 0
    bad, compared = fingerprint_mismatches(trainer, engine)
    if bad:
        raise OutOfSyncError(
            f"the engine does not hold the weights of policy_version {version}: the "
            f"fingerprints of {len(bad)} of {compared} parameters differ (first: {bad[0]}); "
            "the weight push did not reach the engine"
        )
    return compared


#: Rows of a stale batch whose log-probs are recomputed at the generating version: enough to
#: see a lost push (every token of every row moves), cheap next to the update.
CANARY_ROWS = 2


def _assign(param: Tensor, full: Tensor) -> None:
    """Copy the whole tensor `full` into `param`, into its local shard for a DTensor (FSDP2;
    each rank cuts its shard from its own full copy, no communication)."""
    full = full.to(device=param.device, dtype=param.dtype)
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor, distribute_tensor

        dtensor = cast(DTensor, param)  # (`to_local`: a sharded parameter)
        shard = distribute_tensor(full, dtensor.device_mesh, dtensor.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def _reshard(policy: nn.Module) -> None:
    """Free FSDP2's unsharded parameters, so the next forward gathers the shards anew (the
    root stays unsharded after a forward without backward)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def _weights_of(
    policy: nn.Module, weights: dict[str, Tensor], current: dict[str, Tensor] | None
) -> Iterator[None]:
    params = dict(policy.named_parameters())  # tied weights once
    backup = None if current is not None else {n: p.detach().clone() for n, p in params.items()}
    _reshard(policy)
    for name, p in params.items():
        _assign(p.detach(), weights[hf_name(name)])
    try:
        yield
    finally:
        _reshard(policy)
        for name, p in params.items():
            if current is not None:
                _assign(p.detach(), current[hf_name(name)])
            else:
                assert backup is not None  # taken when there is no `current`
                p.detach().copy_(backup[name])


class _Call(nn.Module):
    """`fn()` as the forward of a module that holds `policy`, so that `functional_call` puts
    other values in the policy's parameters for all of `fn` (its LM-head reads included)."""

    def __init__(self, policy: nn.Module, fn: Callable[[], Tensor]):
        super().__init__()
        self.policy, self.fn = policy, fn

    def forward(self) -> Tensor:
        return self.fn()


@torch.no_grad()
def version_logprobs(
    policy: nn.Module,
    weights: dict[str, Tensor],
    rb: RolloutBatch,
    temperature: float,
    chunk_size: int | None,
    rows: int = CANARY_ROWS,
    current: dict[str, Tensor] | None = None,
) -> Tensor | None:
    """`[B, T]` log-probs of the sampled tokens under `weights` (a published version of
    `policy`, by HF name) on the first `rows` rows, NaN elsewhere.

    The policy's own forward runs (FSDP2's included, on the batch's device) with that version's
    values. A plain policy reads them in place of its parameters (`torch.func.functional_call`;
    its own are never touched). FSDP2 shards get them copied in, then the current values are
    put back: from `current` (the current version's published copy, bitwise the trainer's
    weights), else from a copy made here. Every rank must call it (FSDP2's forward is a
    collective). None when the names are not the policy's own.
    """
    params = dict(policy.named_parameters())  # tied weights once
    if any(hf_name(n) not in weights for n in params):
        return None
    head = rb.select(torch.arange(min(rows, rb.batch_size), device=rb.input_ids.device))

    def scored() -> Tensor:
        return response_logprobs(policy, head, temperature, chunk_size)

    if any(hasattr(p, "to_local") for p in params.values()):  # FSDP2 shards: copy in and back
        with _weights_of(policy, weights, current):
            lp = scored()
    else:  # the version's tensors stand in for the parameters: nothing copied or put back
        values = {
            f"policy.{n}": weights[hf_name(n)].to(device=p.device, dtype=p.dtype)
            for n, p in params.items()
        }
        lp = torch.func.functional_call(_Call(policy, scored), values, ())
    out = torch.full(rb.input_ids.shape, float("nan"), dtype=lp.dtype, device=lp.device)
    out[: head.batch_size] = lp
    return out

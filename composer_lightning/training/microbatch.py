"""Micro-batches: the forwards of one optimizer step in pieces a device can hold, with the loss
and gradients of the whole minibatch exactly.

A minibatch (one optimizer step) is cut into micro-batches by a token budget (padded tokens:
rows × the longest row, verl's dynamic batch size) and/or a sample count, the rows bucketed by
length (longest first) so a micro-batch pads to its own longest row, and its columns are cut to
it. Every forward of the step runs per micro-batch: the no-grad old, reference and teacher
recomputes (`targets.rollout_targets`) and the policy's.

The policy's loss is not a sum over micro-batches in general (group baselines, the
`token_sum_norm` normaliser, variance matching, token means), so the step runs in two passes:
1. a no-grad forward per micro-batch gives the minibatch's per-token outputs (log-probs,
   entropies, hidden states; the LM head weight, copied, when heads read it); the objective
   runs ONCE on them as leaf tensors and its backward gives d loss / d output;
2. a forward with grad per micro-batch, then `backward(outputs, d loss / d outputs)`: by the
   chain rule the parameter gradients sum to those of the unbatched step (exact but for the
   order of float additions).
The cost is one more no-grad forward per step; the memory is one micro-batch's activations plus
the minibatch's outputs (`[B, T]` floats; `[B, T, H]` hidden states when a head reads them,
e.g. SDPO, and under FSDP2 then also a copy of the LM head).

Under FSDP2 every forward is a collective: the ranks agree on each forward's count of
micro-batches (the largest) and a rank with fewer runs placeholders (its first row, with zero
gradients). Gradients are reduce-scattered once, at the last backward of the step
(`set_requires_gradient_sync`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.runtime.distributed import StepMetrics, agree


@dataclass(frozen=True)
class MicroBatching:
    """How a minibatch is cut; both None: one forward for the whole minibatch (no cut).

    Attributes:
        max_tokens: padded tokens (rows × longest row) per micro-batch; a row longer than
            this is a micro-batch of its own.
        max_samples: rows per micro-batch.
    """

    max_tokens: int | None = None
    max_samples: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_samples"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"{name} of a micro-batch must be an integer >= 1 or None, got {v!r}"
                )

    @property
    def enabled(self) -> bool:
        return self.max_tokens is not None or self.max_samples is not None


def buckets(lengths: Tensor, max_tokens: int | None, max_samples: int | None) -> list[Tensor]:
    """Row positions of each micro-batch: rows sorted longest first, filled greedily while the
    micro-batch's padded size `rows × longest` stays within `max_tokens` and its rows within
    `max_samples`."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    out: list[list[int]] = []
    for row in order:
        n = int(lengths[row])
        if out:
            current = out[-1]
            longest = int(lengths[current[0]])
            fits_tokens = max_tokens is None or (len(current) + 1) * max(longest, n) <= max_tokens
            fits_rows = max_samples is None or len(current) < max_samples
            if fits_tokens and fits_rows:
                current.append(row)
                continue
        out.append([row])
    device = lengths.device
    return [torch.tensor(sorted(b), dtype=torch.long, device=device) for b in out]


def lengths(mask: Tensor) -> Tensor:
    """`[B]` the columns a row needs: up to its last attended token (right padding)."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * cols).amax(dim=1).clamp(min=1)


def trimmed(mb: RolloutBatch) -> RolloutBatch:
    """`mb` with its student and teacher columns cut to the longest row of each."""
    width = int(lengths(mb.attention_mask).max())
    tw = (
        None if mb.teacher_attention_mask is None else int(lengths(mb.teacher_attention_mask).max())
    )
    cut: dict[str, Any] = {}
    for f in fields(mb):
        v = getattr(mb, f.name)
        if not isinstance(v, Tensor) or v.dim() < 2:
            continue
        if f.name.startswith("candidate_"):  # [B, C, ...]: positions cut like the student's
            if f.name == "candidate_positions":
                cut[f.name] = v[:, :, :width]
            continue
        if f.name == "has_candidate":
            continue
        if f.name.startswith("teacher_") and f.name != "teacher_positions":
            cut[f.name] = v[:, :tw]
        elif v.shape[1] == mb.input_ids.shape[1]:
            cut[f.name] = v[:, :width]
    return replace(mb, **cut)


@dataclass
class Plan:
    """The micro-batches of one minibatch: row positions per forward (None: a placeholder that
    keeps this rank's count of collectives equal to the other ranks')."""

    student: list[Tensor | None]
    teacher: list[Tensor | None]

    def pieces(
        self, mb: RolloutBatch, which: str = "student"
    ) -> Iterator[tuple[Tensor | None, RolloutBatch]]:
        """`(rows, trimmed sub-batch)` per micro-batch; a placeholder is `(None, first row)`."""
        for rows in getattr(self, which):
            first = torch.zeros(1, dtype=torch.long, device=mb.input_ids.device)
            yield rows, trimmed(mb.select(first if rows is None else rows))


def plans(rb: RolloutBatch, splits: list[Tensor], cut: MicroBatching) -> list[Plan]:
    """One plan per minibatch `splits` of `rb`, with every rank's counts made equal (one
    collective for the whole step)."""
    out = []
    for idx in splits:
        mb = rb.select(idx)
        student = buckets(lengths(mb.attention_mask), cut.max_tokens, cut.max_samples)
        teacher_mask = mb.teacher_attention_mask
        teacher = (
            student
            if teacher_mask is None
            else buckets(
                torch.maximum(lengths(mb.attention_mask), lengths(teacher_mask)),
                cut.max_tokens,
                cut.max_samples,
            )
        )
        out.append(Plan(list(student), list(teacher)))
    counts = StepMetrics()
    for i, plan in enumerate(out):
        counts.max(f"student{i}", len(plan.student))
        counts.max(f"teacher{i}", len(plan.teacher))
    agreed = agree(counts)
    for i, plan in enumerate(out):
        plan.student += [None] * (int(agreed[f"student{i}"]) - len(plan.student))
        plan.teacher += [None] * (int(agreed[f"teacher{i}"]) - len(plan.teacher))
    return out


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2's gradient reduce-scatter on (`enabled`) or off for the backwards inside; a
    module that is not FSDP2's is left alone."""
    switch = getattr(model, "set_requires_gradient_sync", None)
    if switch is None:
        yield
        return
    switch(enabled)
    try:
        yield
    finally:
        switch(True)

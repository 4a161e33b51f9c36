"""Padding-free forwards: a right-padded batch run as a few forwards of rows of like length, so
the decoder does (almost) no work on padding.

A rollout batch is right-padded to its longest row: prompts and replies of different lengths
leave padded columns that the decoder's forward and backward compute like any other (the LM
head already skips them, `functional.chunked`). `final_hidden` instead sorts the rows by the
columns they need (up to their last attended token), cuts them into groups, runs one forward per
group with its columns cut to the group's longest row, and puts the final hidden states back in
the batch's rows and columns (zeros at the padded positions, which every output masks). Causal
attention never reads a later column, so every attended token's hidden state is the padded
forward's: the step's loss and gradients are the padded step's (`tests/test_padfree.py`, in
float64), in less time (`bench/step_cost.py --padding`).

Where to cut is a small optimisation: a forward costs a fixed amount beside its tokens (weights
read, kernels started, the embedding gradient), `FORWARD_COST_TOKENS` tokens' worth, so the
groups minimise `padded tokens + FORWARD_COST_TOKENS x forwards` over the rows sorted by length
(`length_groups`, a dynamic programme over the distinct lengths). Equal rows make one forward.

This is TRL's `padding_free` and verl's `use_remove_padding` in spirit; they pack rows into one
sequence behind a varlen (flash) attention kernel, which CPU attention does not have (a
block-diagonal mask costs the packed length squared). Off with `ComposerModule(padding_free=
False)` (the `padding_free` context below); under FSDP2 every forward is a collective whose
count the ranks would have to agree on, so a sharded model always runs one forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor

from composer_lightning.training.microbatch import lengths

#: a forward's fixed cost in tokens of forward and backward: SmolLM2-135M on one CPU thread
#: took 0.73 s for 1 x 64 tokens and 2.22 s for 4 x 64, at 7.7 ms a token in large batches
#: (30-45 tokens' worth); rounded up, since a smaller matmul also runs slower
FORWARD_COST_TOKENS = 64

_ENABLED: ContextVar[bool] = ContextVar("padding_free", default=True)


@contextlib.contextmanager
def padding_free(enabled: bool) -> Iterator[None]:
    """Forwards inside run padding-free (`enabled`, the default outside) or as one padded
    forward."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    """Whether forwards run padding-free here (`padding_free`)."""
    return _ENABLED.get()


def length_groups(widths: list[int], forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Row positions of each forward: the rows sorted by `widths` (longest first, ties in row
    order), cut where `sum(rows x longest) + forward_cost x forwards` is least.

    Only a cut between two different widths can pay, so the programme runs over the distinct
    widths: O(distinct²)."""
    if not widths:
        return []
    if forward_cost < 0:
        raise ValueError(f"forward_cost must be >= 0 tokens, got {forward_cost}")
    order = sorted(range(len(widths)), key=lambda r: -widths[r])
    starts = [0] + [i for i in range(1, len(order)) if widths[order[i]] != widths[order[i - 1]]]
    ends = starts[1:] + [len(order)]
    n = len(starts)
    best = [0.0] + [float("inf")] * n  # best[j]: the first j width classes, in groups
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # a group of classes i..j-1, padded to class i's width
            cost = best[i] + (ends[j - 1] - starts[i]) * widths[order[starts[i]]] + forward_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        groups.append(order[starts[i] : ends[j - 1]])
        j = i
    return groups[::-1]


def grouped_states(
    forward: Callable[[Tensor, Tensor], Tensor], input_ids: Tensor, attention_mask: Tensor
) -> Tensor:
    """`[B, T, H]` final hidden states of a right-padded batch from one `forward(ids, mask)`
    per `length_groups` group, each cut to its longest row; zeros past a row's last attended
    token. One group of every row at full width is the plain padded forward."""
    T = input_ids.shape[1]
    widths = lengths(attention_mask).tolist()
    groups = length_groups(widths, FORWARD_COST_TOKENS)
    if len(groups) == 1 and max(widths) == T:
        return forward(input_ids, attention_mask)
    parts = []
    for rows in groups:
        w = max(widths[r] for r in rows)
        index = torch.tensor(rows, device=input_ids.device)
        states = forward(input_ids[index, :w], attention_mask[index, :w])
        parts.append(F.pad(states, (0, 0, 0, T - w)))
    order = torch.tensor([r for rows in groups for r in rows], device=input_ids.device)
    return torch.cat(parts)[torch.argsort(order)]

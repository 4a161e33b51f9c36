"""Mixing heads: per-term statistics, variance matching and gradient-norm matching.

Variance matching (docs/design.md, "Heads") rescales each advantage term by σ(reference term) /
σ(term), σ measured over the term's active tokens of the minibatch, detached; a term with σ = 0
(or a reference with σ = 0) keeps its weight.

Gradient-norm matching rescales every head, advantage and loss heads alike, by ‖ĝ_ref‖ / ‖ĝ_h‖,
the norms of their unweighted pieces' gradients at the policy's final hidden states on the
minibatch (`functional/gradients.py`), detached. Variance matching equalises the spread of the
advantage terms, which says nothing of a loss head (SDPO's JSD, DPO) nor of how strongly a term
moves the policy; the gradient norm is the one scale every head has in common (GradNorm's, Chen
et al. 2018). A head's piece is positively homogeneous in its weight, so after the rescaling
head h pulls with `w_h / w_ref` times the reference's norm: as with variance matching (σ of the
unweighted terms), the weights and their schedules keep their meaning, now as ratios of
gradient norms (a warm-up still starts small); equal weights give equal norms.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class AdvantageTerm(NamedTuple):
    """One head's advantage term: its name, effective weight, `[B, T]` values and active mask."""

    name: str
    weight: float
    advantages: Tensor
    active: Tensor


def masked_stats(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and population std of `values` over `mask` (detached; zeros on an empty mask)."""
    v = values.detach()[mask.bool()]
    if v.numel() == 0:
        return torch.zeros(()), torch.zeros(())
    return v.mean(), v.std(unbiased=False)


def variance_scales(terms: list[AdvantageTerm], reference: str | None) -> dict[str, float]:
    """Per-term multipliers: 1 without a reference, else σ(reference) / σ(term)."""
    scales = {t.name: 1.0 for t in terms}
    if reference is None:
        return scales
    sigma = {t.name: float(masked_stats(t.advantages, t.active)[1]) for t in terms}
    ref = sigma.get(reference, 0.0)
    for name, s in sigma.items():
        if s > 0 and ref > 0:
            scales[name] = ref / s
    return scales


def grad_norm_scales(sq_norms: dict[str, float], reference: str) -> dict[str, float]:
    """Per-head multipliers ‖ĝ_ref‖ / ‖ĝ_h‖ from the squared gradient norms of the unweighted
    pieces (`functional/gradients.py`); a head with ‖ĝ_h‖ = 0 (or a reference with 0, or one
    that is off) keeps its weight."""
    ref = sq_norms.get(reference, 0.0)
    return {
        name: math.sqrt(ref / sq) if sq > 0 and ref > 0 else 1.0 for name, sq in sq_norms.items()
    }


def teacher_cap_scales(
    gram: Tensor, names: list[str], teachers: set[str], cap: float, alone: float = 0.0
) -> dict[str, float]:
    """Per-head multipliers that cap each teacher head's pull at `cap` times the others'.

    With `g_h` each weighted piece's gradient (the rows of `gram`, `[H, H]`, in the order of
    `names`) and `g_rest` the sum of the pieces that read no teacher: a teacher head h is
    scaled by `min(1, cap · ‖g_rest‖ / ‖g_h‖)`, so its gradient is never more than `cap` times
    the rest's; the others keep 1. With no rest gradient (no group where RL has a signal) it
    is scaled by `alone` (0: a teacher signal never leads alone). `cap` bounds a norm, not a
    direction: the pieces stay as they are otherwise.
    """
    rest = [i for i, n in enumerate(names) if n not in teachers]
    idx = torch.tensor(rest, dtype=torch.long)
    rest_sq = float(gram[idx][:, idx].sum()) if rest else 0.0
    rest_norm = math.sqrt(max(rest_sq, 0.0))
    scales = {}
    for i, name in enumerate(names):
        own = math.sqrt(max(float(gram[i, i]), 0.0))
        if name not in teachers or own == 0.0:
            scales[name] = 1.0
        elif rest_norm == 0.0:
            scales[name] = alone
        else:
            scales[name] = min(1.0, cap * rest_norm / own)
    return scales

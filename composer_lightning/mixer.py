"""Mixing advantage terms: per-term statistics and variance matching (DESIGN.md "Heads").

Variance matching rescales each advantage term by σ(reference term) / σ(term), σ measured over
the term's active tokens of the minibatch, detached; a term with σ = 0 (or a reference with
σ = 0) keeps its weight.
"""

from __future__ import annotations

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

"""Shared argument validation for `composer_lightning.functional`.

Every check raises `ValueError` with a message that names the offending value and what was
expected, so a misconfigured head fails at the call site rather than with a broadcasting error
three frames deeper.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def shape_str(t: Tensor) -> str:
    """Format a shape as `[2, 5]`."""
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def check_same_shape(*named: tuple[str, Tensor]) -> None:
    """Require every `(name, tensor)` pair to have the shape of the first one."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{first_name} {shape_str(first)} and {name} {shape_str(t)} "
                "must have the same shape"
            )


def check_ndim(name: str, t: Tensor, ndims: Iterable[int]) -> None:
    """Require `t.ndim` to be one of `ndims`."""
    ndims = tuple(ndims)
    if t.ndim not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {want}, got shape {shape_str(t)}")


def check_range(
    name: str,
    value: float,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_closed: bool = False,
    high_closed: bool = False,
) -> None:
    """Require `value` to lie in the interval described by the bounds (NaN always fails)."""
    v = float(value)
    ok_low = v >= low if low_closed else v > low
    ok_high = v <= high if high_closed else v < high
    if not (ok_low and ok_high):  # also rejects NaN: every comparison is False
        lo = ("[" if low_closed else "(") + _fmt(low)
        hi = _fmt(high) + ("]" if high_closed else ")")
        raise ValueError(f"{name} must be in {lo}, {hi}, got {value!r}")


def check_choice(name: str, value: str, allowed: Iterable[str]) -> None:
    """Require `value` to be one of `allowed`."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


def as_bool_mask(mask: Tensor) -> Tensor:
    """A bool view of a bool or 0/1 float mask (non-zero means selected)."""
    return mask if mask.dtype == torch.bool else mask != 0


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:g}"

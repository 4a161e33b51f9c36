"""Per-head gradients at given tensors, their Gram matrix and shares, in float64 by hand."""

from __future__ import annotations

import pytest
import torch

from composer_lightning.functional.gradients import (
    gradient_gram,
    gradient_shares,
    hidden_gradients,
    scaled_gram,
)


def test_hidden_gradients_by_hand_and_the_graph_survives():
    """pieces a = Σ x², b = Σ x·y, c = Σ y³ at (x, y): ∂a = (2x, —), ∂b = (y, x), ∂c = (—,
    3y²); a piece that does not reach a tensor gets None there, and `.grad` stays untouched so
    the loss can still be backpropagated afterwards."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randn(1, 5, 4, generator=g, dtype=torch.float64).requires_grad_()
    xx, yy = x * 1.0, y * 1.0  # non-leaves, as the policy's states are
    pieces = {"a": (xx**2).sum(), "b": (xx[:1, :1] * yy[:, :1]).sum(), "c": (yy**3).sum()}
    grads = hidden_gradients(pieces, [xx, yy])
    torch.testing.assert_close(grads["a"][0], 2 * x.detach(), rtol=0, atol=1e-12)
    assert grads["a"][1] is None and grads["c"][0] is None
    by_hand_bx = torch.zeros_like(x)
    by_hand_bx[:1, :1] = y.detach()[:, :1]
    torch.testing.assert_close(grads["b"][0], by_hand_bx, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["c"][1], 3 * y.detach() ** 2, rtol=0, atol=1e-12)
    assert x.grad is None
    sum(pieces.values()).backward()  # retained graph
    assert x.grad is not None


def _random_grads():
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 3, 4), (1, 2, 4)]
    grads = {
        name: [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        for name in ("a", "b", "c")
    }
    grads["c"][1] = None  # c does not reach the second tensor
    grads["b"] = [-3.0 * grads["a"][0] + 0.1 * grads["b"][0], grads["b"][1]]  # against a
    return grads


def _flat(parts):
    return torch.cat([p.flatten() for p in parts])


def test_gram_and_shares_equal_the_concatenated_gradients_and_sum_to_one():
    """Over disjoint tensors the gradient is the concatenation: G_hk = <g_h, g_k> of the
    concatenations (None = zeros there); share_h = <g_h, g> / ‖g‖², g = Σ g_h, and the
    shares sum to 1; a head pulling against the others has a negative share."""
    grads = _random_grads()
    full = {
        n: _flat([p if p is not None else torch.zeros(1, 2, 4, dtype=torch.float64) for p in ps])
        for n, ps in grads.items()
    }
    names = list(full)
    gram = gradient_gram(grads)
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            assert float(gram[i, j]) == pytest.approx(float(full[a] @ full[b]), abs=1e-12)
    total = sum(full.values())
    shares = gradient_shares(gram, names)
    for n in names:
        want = float(full[n] @ total / (total @ total))
        assert shares[f"{n}/grad_share"] == pytest.approx(want, abs=1e-12)
        assert shares[f"{n}/grad_norm"] == pytest.approx(float(full[n].norm()), abs=1e-12)
    assert sum(shares[f"{n}/grad_share"] for n in names) == pytest.approx(1.0, abs=1e-12)
    assert shares["b/grad_share"] < 0 or shares["a/grad_share"] < 0


def test_scaled_gram_is_the_gram_of_scaled_gradients_and_a_zero_gradient_has_no_share():
    grads = _random_grads()
    s = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    scaled = {
        n: [None if p is None else k * p for p in ps]
        for (n, ps), k in zip(grads.items(), s.tolist(), strict=True)
    }
    torch.testing.assert_close(
        scaled_gram(gradient_gram(grads), s), gradient_gram(scaled), rtol=0, atol=1e-12
    )
    zero = gradient_shares(torch.zeros(2, 2, dtype=torch.float64), ["a", "b"])
    assert zero == {
        "a/grad_norm": 0.0,
        "a/grad_share": 0.0,
        "b/grad_norm": 0.0,
        "b/grad_share": 0.0,
    }

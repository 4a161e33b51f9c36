"""Schulman's KL estimators against per-element math, invariants and masking."""

import math

import pytest
import torch

from composer_lightning.functional import kl_penalty

REF = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr * lr,
    "k3": lambda lr: math.exp(lr) - 1 - lr,
}


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_matches_per_element_reference(kind):
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    got = kl_penalty(lp, ref, kind)
    for b in range(3):
        for t in range(5):
            want = REF[kind](ref[b, t].item() - lp[b, t].item())
            assert abs(got[b, t].item() - want) < 1e-12


def test_hand_values_and_invariants():
    """log rho = ref - logprobs = -1 - (-2) = 1: k1 = -1, k2 = 0.5, k3 = e - 2."""
    lp, ref = (
        torch.tensor([[-2.0]], dtype=torch.float64),
        torch.tensor([[-1.0]], dtype=torch.float64),
    )
    assert kl_penalty(lp, ref, "k1").item() == -1.0
    assert kl_penalty(lp, ref, "k2").item() == 0.5
    assert abs(kl_penalty(lp, ref, "k3").item() - (math.e - 2)) < 1e-15
    same = torch.randn(4, 4, dtype=torch.float64)
    for kind in REF:
        assert (kl_penalty(same, same, kind) == 0).all()
    x, y = torch.randn(50, 7, dtype=torch.float64), torch.randn(50, 7, dtype=torch.float64)
    assert (kl_penalty(x, y, "k2") >= 0).all() and (kl_penalty(x, y, "k3") >= 0).all()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_mask_zeroes_value_and_gradient(kind):
    lp = torch.tensor([[-1.0, math.nan], [-0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [math.inf, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [0, 1]])
    out = kl_penalty(lp, ref, kind, response_mask=mask)
    assert out[0, 1].item() == 0.0 and out[1, 0].item() == 0.0
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 0].item() == 0.0


def test_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"'k4'.*k1, k2, k3"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match=r"logprobs \[2, 3\] and ref_logprobs \[2, 4\]"):
        kl_penalty(x, torch.zeros(2, 4), "k3")
    with pytest.raises(ValueError, match=r"response_mask \[3\]"):
        kl_penalty(x, x, "k3", response_mask=torch.ones(3))

"""Sigmoid DPO (with cDPO label smoothing) against scalar math."""

import math

import pytest
import torch
import torch.nn.functional as F

from composer_lightning.functional import dpo_loss, dpo_rewards


def log_sigmoid(x):
    return math.log(1 / (1 + math.exp(-x)))


def ref_dpo(pc, pr, rc, rr, beta, eps):
    losses = []
    for a, b, c, d in zip(pc, pr, rc, rr, strict=True):
        z = (a - c) - (b - d)
        losses.append(-(1 - eps) * log_sigmoid(beta * z) - eps * log_sigmoid(-beta * z))
    return sum(losses) / len(losses)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_hand_example():
    """pi_c = -1, ref_c = -1.5, pi_r = -2, ref_r = -1.8: z = 0.5 - (-0.2) = 0.7, beta z = 0.07.
    eps = 0: L = -log sigma(0.07) = 0.658760...; eps = 0.1: 0.9 * that - 0.1 * log sigma(-0.07)."""
    args = (t(-1.0), t(-2.0), t(-1.5), t(-1.8))
    plain = -log_sigmoid(0.07)
    assert abs(plain - 0.6587596) < 1e-6
    assert abs(dpo_loss(*args, beta=0.1).item() - plain) < 1e-12
    smooth = -0.9 * log_sigmoid(0.07) - 0.1 * log_sigmoid(-0.07)
    assert abs(dpo_loss(*args, beta=0.1, label_smoothing=0.1).item() - smooth) < 1e-12
    chosen, rejected = dpo_rewards(*args, beta=0.1)
    assert abs(chosen.item() - 0.05) < 1e-12 and abs(rejected.item() - (-0.02)) < 1e-12


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (0.5, 0.2), (2.0, 0.45)])
def test_matches_reference(beta, eps):
    g = torch.Generator().manual_seed(4)
    xs = [-torch.rand(9, generator=g, dtype=torch.float64) * 20 for _ in range(4)]
    got = dpo_loss(*xs, beta=beta, label_smoothing=eps).item()
    assert abs(got - ref_dpo(*(x.tolist() for x in xs), beta, eps)) < 1e-12


def test_eps_zero_is_plain_sigmoid_and_gradcheck():
    g = torch.Generator().manual_seed(5)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) for _ in range(4))
    z = (pc - rc) - (pr - rr)
    assert torch.allclose(
        dpo_loss(pc, pr, rc, rr, beta=0.3), -F.logsigmoid(0.3 * z).mean(), rtol=0, atol=1e-14
    )
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: dpo_loss(a, b, rc, rr, beta=0.3, label_smoothing=0.2), (pc, pr)
    )
    chosen, rejected = dpo_rewards(pc, pr, rc, rr, beta=0.3)
    assert not chosen.requires_grad and not rejected.requires_grad
    assert torch.allclose(chosen - rejected, 0.3 * z, rtol=0, atol=1e-14)


def test_empty_is_zero():
    e = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    out = dpo_loss(e, e, e, e)
    assert out.item() == 0.0 and out.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"beta": 0.0}, r"beta must be in \(0, inf\), got 0.0"),
        ({"beta": -1.0}, r"got -1.0"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\), got 0.5"),
        ({"label_smoothing": -0.1}, r"got -0.1"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=pattern):
        dpo_loss(x, x, x, x, **kwargs)


def test_shape_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"chosen_logprobs \[3\] and ref_rejected_logprobs \[2\]"):
        dpo_loss(x, x, x, torch.zeros(2))
    with pytest.raises(ValueError, match=r"chosen_logprobs must be 1-D"):
        dpo_rewards(torch.zeros(3, 1), x, x, x)
    with pytest.raises(ValueError, match=r"beta must be in"):
        dpo_rewards(x, x, x, x, beta=0)

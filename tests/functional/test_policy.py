"""`policy_loss` against a per-token loop reference, hand examples, gradcheck and masking."""

import math

import pytest
import torch

from composer_lightning.functional import policy_loss


def ref_token_loss(lp, old, a, clip_low=0.2, clip_high=0.28, dual=None):
    r = math.exp(lp - old)
    out = max(-r * a, -min(max(r, 1 - clip_low), 1 + clip_high) * a)
    if dual is not None and a < 0:
        out = min(out, -dual * a)
    return out


def ref_loss(lp, old, adv, mask, dual, norm_length):
    """token_sum_norm over nested lists: sum over masked tokens / (B * norm_length)."""
    total = 0.0
    for rows in zip(lp, old, adv, mask, strict=True):
        for x, o, a, m in zip(*rows, strict=True):
            if m:
                total += ref_token_loss(x, o, a, dual=dual)
    return total / (len(lp) * norm_length)


def make_inputs(seed=0, shape=(4, 6)):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    lp = old + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 1.6  # r in [.45, 2.2]
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.3
    return lp, old, adv, mask


@pytest.mark.parametrize("dual", [None, 1.5])
def test_matches_loop_reference(dual):
    lp, old, adv, mask = make_inputs()
    loss, metrics = policy_loss(lp, old, adv, mask, dual_clip=dual, norm_length=8)
    want = ref_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), dual, 8)
    assert abs(loss.item() - want) < 1e-12
    ratios = [
        math.exp(x - o)
        for x, o, m in zip(
            lp.flatten().tolist(), old.flatten().tolist(), mask.flatten().tolist(), strict=True
        )
        if m
    ]
    assert abs(metrics["ratio_mean"].item() - sum(ratios) / len(ratios)) < 1e-12
    assert abs(metrics["ratio_max"].item() - max(ratios)) < 1e-12
    assert ("dual_clipfrac" in metrics) == (dual is not None)
    assert all(not v.requires_grad and v.ndim == 0 for v in metrics.values())


def test_clipfrac_hand_example():
    """Four tokens, clip [0.8, 1.28], token_mean:
    r=1.5, A=+1: max(-1.5, -1.28) = -1.28  (clipped branch taken)
    r=0.5, A=+1: max(-0.5, -0.8)  = -0.5   (unclipped)
    r=0.5, A=-1: max(0.5, 0.8)    =  0.8   (clipped branch taken)
    r=1.0, A=+1: max(-1, -1)      = -1     (tie: not counted)
    loss = (-1.28 - 0.5 + 0.8 - 1) / 4 = -0.495; clipfrac = 2/4; ratio_mean = 3.5/4."""
    r = torch.tensor([[1.5, 0.5, 0.5, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    old = torch.zeros_like(r)
    loss, m = policy_loss(r.log(), old, adv, torch.ones_like(r), aggregation="token_mean")
    assert abs(loss.item() - (-0.495)) < 1e-12
    assert m["clipfrac"].item() == 0.5
    assert abs(m["ratio_mean"].item() - 0.875) < 1e-12
    assert abs(m["ratio_max"].item() - 1.5) < 1e-12


def test_dual_clip_hand_example():
    """c = 3, A = -1: r=5 -> min(max(5, 1.28), 3) = 3 (dual taken); r=2 -> min(2, 3) = 2;
    r=5, A=+1 -> max(-5, -1.28) = -1.28 (dual never applies to A > 0).
    token_mean = (3 + 2 - 1.28) / 3 = 1.24; dual_clipfrac = 1/3."""
    r = torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, m = policy_loss(
        r.log(),
        torch.zeros_like(r),
        adv,
        torch.ones_like(r),
        dual_clip=3.0,
        aggregation="token_mean",
    )
    assert abs(loss.item() - 1.24) < 1e-12
    assert abs(m["dual_clipfrac"].item() - 1 / 3) < 1e-12


@pytest.mark.parametrize("dual", [None, 3.0])
def test_gradcheck_inside_and_outside_clip(dual):
    # log-ratios well away from log(0.8) = -0.223 and log(1.28) = 0.247 (and from log 3 for dual)
    log_r = torch.tensor([[-0.6, -0.1, 0.05, 0.15], [0.5, 1.4, -1.2, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -0.5, 0.7, -1.3], [2.0, -0.4, 0.9, 1.1]], dtype=torch.float64)
    old = torch.full_like(log_r, -1.0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    lp = (old + log_r).requires_grad_(True)

    def f(x):
        return policy_loss(x, old, adv, mask, dual_clip=dual, aggregation="seq_mean_token_mean")

    _, metrics = f(lp)
    assert metrics["clipfrac"].item() == 2 / 7  # tokens (0, 0) and (1, 0) take the clipped branch
    if dual is not None:
        assert metrics["dual_clipfrac"].item() == 1 / 7  # token (1, 1): r = e^1.4, A < 0
    assert torch.autograd.gradcheck(lambda x: f(x)[0], (lp,))


def test_log_ratio_is_clamped_before_exp():
    """verl's clamp of the log-ratio to [-20, 20]: log r = +1000 with A = -1 gives
    max(r, 1.28) = e^20 (not inf); log r = -1000 with A = +1 gives max(-e^-20, -0.8) = -e^-20.
    token_mean = (e^20 - e^-20) / 2, and a clamped token passes no gradient through r."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[1000.0, -1000.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 2), aggregation="token_mean")
    assert abs(loss.item() - (math.exp(20) - math.exp(-20)) / 2) < 1e-12 * math.exp(20)
    assert m["ratio_max"].item() == math.exp(20.0)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad == 0).all()


def test_masked_tokens_get_zero_gradient_and_nan_does_not_leak():
    lp, old, adv, mask = make_inputs(seed=3)
    lp, old, adv = lp.clone(), old.clone(), adv.clone()
    lp[~mask], old[~mask], adv[~mask] = math.nan, math.inf, math.nan
    lp.requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask.float(), dual_clip=2.0, norm_length=6)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()


def test_empty_mask():
    lp = torch.full((2, 3), math.nan, dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(2, 3), norm_length=3)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in m.values())
    loss.backward()
    assert (lp.grad == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"clip_low": 0.0}, r"clip_low must be in \(0, 1\), got 0.0"),
        ({"clip_low": 1.0}, r"clip_low must be in \(0, 1\), got 1.0"),
        ({"clip_high": -0.1}, r"clip_high must be in \(0, inf\), got -0.1"),
        ({"dual_clip": 1.0}, r"dual_clip must be in \(1, inf\), got 1.0"),
        ({"aggregation": "sum"}, r"'sum'"),
        ({"aggregation": "token_sum_norm"}, "norm_length is required"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=pattern):
        policy_loss(x, x, x, torch.ones(2, 3), **kwargs)


def test_shape_mismatch():
    x = torch.zeros(2, 5)
    with pytest.raises(
        ValueError, match=r"logprobs \[2, 5\] and response_mask \[2, 4\] must have the same shape"
    ):
        policy_loss(x, x, x, torch.ones(2, 4), norm_length=4)
    with pytest.raises(ValueError, match=r"logprobs \[2, 5\] and advantages \[2\]"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 5), norm_length=4)

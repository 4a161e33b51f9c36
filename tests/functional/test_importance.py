"""Truncated importance weights and the weighted surrogate against loop references."""

import math

import pytest
import torch

from composer_lightning.functional import policy_loss, truncated_importance_weights
from tests.functional.test_policy import make_inputs, ref_token_loss


def test_weights_match_loop_reference():
    old, _, _, mask = make_inputs(seed=1)
    g = torch.Generator().manual_seed(2)
    behavior = old + (torch.rand(old.shape, generator=g, dtype=torch.float64) - 0.5) * 3
    weights, metrics = truncated_importance_weights(old, behavior, mask, cap=2.0)
    raw, kept = [], []
    for o, b, m, w in zip(
        old.flatten().tolist(),
        behavior.flatten().tolist(),
        mask.flatten().tolist(),
        weights.flatten().tolist(),
        strict=True,
    ):
        if m:
            raw.append(math.exp(o - b))
            kept.append(min(math.exp(o - b), 2.0))
            assert abs(w - kept[-1]) < 1e-12
        else:
            assert w == 1.0
    assert abs(metrics["weight_mean"].item() - sum(kept) / len(kept)) < 1e-12
    assert abs(metrics["weight_max"].item() - max(raw)) < 1e-12
    assert abs(metrics["clipped_frac"].item() - sum(r > 2.0 for r in raw) / len(raw)) < 1e-12
    assert 0 < metrics["clipped_frac"].item() < 1  # the example exercises both sides


def test_weights_are_detached_and_bounded():
    old = torch.tensor([[0.0, -50.0, float("nan")]], requires_grad=True)
    behavior = torch.tensor([[-60.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    weights, metrics = truncated_importance_weights(old, behavior, mask, cap=3.0)
    assert not weights.requires_grad
    assert weights.tolist()[0][0] == pytest.approx(3.0)  # exp(60) truncated, no overflow
    assert weights.tolist()[0][1] == pytest.approx(math.exp(-20.0))  # clamped below
    assert weights.tolist()[0][2] == 1.0  # NaN at a masked position never leaks
    assert math.isfinite(metrics["weight_max"].item())


def test_empty_mask_and_bad_cap():
    x = torch.zeros(2, 3)
    _, metrics = truncated_importance_weights(x, x, torch.zeros(2, 3, dtype=torch.bool), 2.0)
    assert metrics["weight_mean"].item() == 1.0 and metrics["clipped_frac"].item() == 0.0
    with pytest.raises(ValueError, match=r"importance cap must be in \[1"):
        truncated_importance_weights(x, x, x.bool(), 0.5)
    with pytest.raises(ValueError, match="behavior_logprobs"):
        truncated_importance_weights(x, torch.zeros(2, 4), x.bool(), 2.0)


def test_weighted_surrogate_matches_loop_reference():
    lp, old, adv, mask = make_inputs(seed=3)
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    loss, _ = policy_loss(lp, old, adv, mask, norm_length=8, weights=w, aggregation="token_mean")
    total, n = 0.0, 0
    for row in zip(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), w.tolist(), strict=True):
        for x, o, a, m, wt in zip(*row, strict=True):
            if m:
                total += wt * ref_token_loss(x, o, a)
                n += 1
    assert abs(loss.item() - total / n) < 1e-12


def test_unit_weights_change_nothing_and_gradient_is_scaled():
    lp, old, adv, mask = make_inputs(seed=5)
    lp = lp.clone().requires_grad_(True)
    plain, _ = policy_loss(lp, old, adv, mask, norm_length=8)
    ones, _ = policy_loss(lp, old, adv, mask, norm_length=8, weights=torch.ones_like(lp))
    assert plain.item() == ones.item()
    (g_plain,) = torch.autograd.grad(plain, lp)
    w = torch.full_like(lp, 0.5)
    half, _ = policy_loss(lp, old, adv, mask, norm_length=8, weights=w)
    (g_half,) = torch.autograd.grad(half, lp)
    torch.testing.assert_close(g_half, 0.5 * g_plain, rtol=0, atol=1e-15)


def test_a_token_the_engine_could_not_score_weighs_one_and_the_loss_stays_finite():
    """A NaN behaviour log-prob on a response token (the engine could not score it) is no
    evidence: weight 1, as TRL maps a NaN log-ratio to 0; the other tokens keep their weights,
    the metrics and the weighted surrogate stay finite. The off-policy mask reads the same
    token the same way (one convention, `scored_log_ratio`)."""
    from composer_lightning.functional import off_policy_sequence_mask, scored_log_ratio

    logprobs, old, adv, mask = make_inputs(seed=3)
    behavior = old - 0.3
    row, col = (int(i) for i in torch.nonzero(mask)[0])
    behavior[row, col] = float("nan")
    weights, metrics = truncated_importance_weights(old, behavior, mask, cap=2.0)
    assert weights[row, col].item() == 1.0
    others = mask.clone()
    others[row, col] = False
    torch.testing.assert_close(
        weights[others], torch.full_like(weights[others], math.exp(0.3)), rtol=0, atol=1e-12
    )
    assert all(math.isfinite(v.item()) for v in metrics.values())
    loss, _ = policy_loss(logprobs, old, adv, mask, weights=weights, norm_length=8)
    assert math.isfinite(loss.item())
    log_ratio = scored_log_ratio(old, behavior, mask)
    assert log_ratio[row, col].item() == 0.0
    torch.testing.assert_close(log_ratio[others], torch.full_like(log_ratio[others], 0.3))
    # the mask reads `behaviour − π` as the evidence: the row's mean counts the unscored token
    # as 0, 0.3 · (n − 1) / n, under a threshold of 0.3 the row's negative tokens are kept; a
    # NaN taken as anything else would drop them or poison the mean
    kept = off_policy_sequence_mask(-adv.abs() - 1, old, behavior, mask, threshold=0.3)
    assert kept[row].sum() == mask[row].sum()
    kept = off_policy_sequence_mask(-adv.abs() - 1, old, behavior, mask, threshold=0.29)
    n = int(mask[row].sum())
    assert kept[row].sum() == (mask[row].sum() if 0.3 * (n - 1) / n <= 0.29 else 0)

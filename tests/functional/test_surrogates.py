"""GSPO, GSPO-token, CISPO, SAPO, TRL's `delta`, the high-entropy mask, the off-policy sequence
mask and the entropy bonus against TRL 1.16's own code (values and gradients, float64), against
hand-derived cases, and the invariant that ties them: at r = 1 every surrogate has PPO's
gradient."""

from __future__ import annotations

import math

import pytest
import torch

from composer_lightning.functional import (
    high_entropy_mask,
    importance_log_ratio,
    masked_aggregate,
    off_policy_sequence_mask,
    policy_loss,
)


def trl_loss(
    per_token_logps,
    old_per_token_logps,
    advantages,
    mask,
    *,
    loss_type,
    importance_sampling_level="token",
    epsilon_low=0.2,
    epsilon_high=0.28,
    delta=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    max_completion_length=None,
    entropies=None,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    sampling_per_token_logps=None,
    entropy_coef=0.0,
):
    """TRL 1.16 `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py, lines 3049-3211),
    transcribed for one process, no gradient accumulation, beta = 0 and no vLLM IS correction;
    `get_high_entropy_mask` (1380-1416) and `get_off_policy_mask` (2945-2968) inline."""
    mask = mask.to(per_token_logps.dtype)
    if top_entropy_quantile < 1.0:
        gathered = entropies[mask.bool()].float().to(entropies.dtype)
        entropy_threshold = torch.quantile(gathered, 1 - top_entropy_quantile)
        masked_entropies = entropies * mask.float()
        entropy_mask = (masked_entropies >= entropy_threshold) & mask.bool()
    else:
        entropy_mask = None
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if off_policy_mask_threshold is not None:
        sampling = (
            old_per_token_logps if sampling_per_token_logps is None else sampling_per_token_logps
        )
        kl_div = sampling - per_token_logps.detach()
        kl_div = torch.nan_to_num(kl_div, nan=0.0)
        seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
        avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((advantages >= 0) | (avg_seq_kl <= off_policy_mask_threshold)).to(
            dtype=mask.dtype
        )
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        # TRL's scalars make float32 temperatures (1.05 ≠ 1.05 in float64 by 2e-8): float64 here
        pos, neg = (
            torch.tensor(t, dtype=advantages.dtype)
            for t in (sapo_temperature_pos, sapo_temperature_neg)
        )
        temperatures = torch.where(advantages > 0, pos, neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type in ["cispo", "dapo"]:  # num_items_in_batch: the batch's response tokens
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if entropy_coef:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
        loss = loss - entropy_coef * entropy_loss
    return loss


AGGREGATION = {
    "dr_grpo": "token_sum_norm",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "grpo": "seq_mean_token_mean",
    "sapo": "seq_mean_token_mean",
}


def make_inputs(seed=0, shape=(4, 6), per_sequence=True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    lp = old + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 1.6
    if per_sequence:
        adv = torch.randn(shape[0], 1, generator=g, dtype=torch.float64).expand(shape).clone()
    else:
        adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.25
    mask[:, 0] = True
    ent = torch.rand(shape, generator=g, dtype=torch.float64) * 2
    return lp, old, adv, mask, ent


def ours_and_trls(loss_type, level="token", per_sequence=True, **kw):
    lp, old, adv, mask, _ = make_inputs(per_sequence=per_sequence)
    lp1, lp2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    mode = loss_type if loss_type in ("cispo", "sapo") else "clip"
    ours, _ = policy_loss(
        lp1,
        old,
        adv,
        mask,
        aggregation=AGGREGATION[loss_type],
        norm_length=6,
        loss_mode=mode,
        ratio_level=level,
        **kw,
    )
    trl_kw = {"epsilon_high": 1 + kw.get("clip_high", 0.28)} if loss_type == "cispo" else {}
    if "dual_clip" in kw:
        trl_kw["delta"] = kw["dual_clip"]
    want = trl_loss(
        lp2,
        old,
        adv,
        mask,
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=6,
        **trl_kw,
    )
    ours.backward()
    want.backward()
    return ours, want, lp1.grad, lp2.grad


@pytest.mark.parametrize("loss_type", ["dr_grpo", "bnpo", "grpo", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("per_sequence", [True, False])
def test_equals_trls_loss_and_gradient(loss_type, level, per_sequence):
    ours, want, g_ours, g_want = ours_and_trls(loss_type, level, per_sequence)
    assert abs(ours.item() - want.item()) < 1e-12
    assert torch.allclose(g_ours, g_want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_dual_clip_is_trls_delta_above_one_plus_clip_high(level):
    """TRL's two-sided `delta` caps the unclipped ratio; for delta > 1 + epsilon_high that is
    dual-clip PPO: the same loss and the same (zero beyond delta) gradient."""
    ours, want, g_ours, g_want = ours_and_trls("dr_grpo", level, False, dual_clip=1.4)
    assert abs(ours.item() - want.item()) < 1e-12
    assert torch.allclose(g_ours, g_want, atol=1e-12, rtol=0)


def test_gspo_hand_example():
    """One sequence of two tokens, log-ratios 0.2 and -0.6: s = exp(-0.2) = 0.8187 inside
    [0.8, 1.28]; A = 1, token_mean: l = -s on both tokens, loss -s; d loss / d lp_t =
    -s * (1/2) on each token (the mean's share)."""
    lp = torch.tensor([[0.2, -0.6]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(lp, old, adv, mask, aggregation="token_mean", ratio_level="sequence")
    s = math.exp(-0.2)
    assert abs(loss.item() + s) < 1e-12
    assert abs(m["ratio_mean"].item() - s) < 1e-12
    loss.backward()
    assert torch.allclose(lp.grad, torch.full((1, 2), -s / 2, dtype=torch.float64), atol=1e-12)


def test_gspo_token_hand_example():
    """GSPO-token with per-token advantages A = (1, -2), the same sequence: the value of each
    token's ratio is s, its gradient the token's own: d loss / d lp_t = -s * A_t / 2 (token
    mean), where GSPO would give every token -s * mean(A) / 2."""
    lp = torch.tensor([[0.2, -0.6]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss(
        lp, old, adv, mask, aggregation="token_mean", ratio_level="sequence_token"
    )
    s = math.exp(-0.2)
    assert abs(loss.item() - (-s * 1 + s * 2) / 2) < 1e-12
    loss.backward()
    want = torch.tensor([[-s * 1 / 2, -s * -2 / 2]], dtype=torch.float64)
    assert torch.allclose(lp.grad, want, atol=1e-12)
    log_ratio = importance_log_ratio(lp.detach(), old, mask, "sequence_token")
    assert torch.allclose(log_ratio, torch.full((1, 2), -0.2, dtype=torch.float64), atol=1e-12)


def test_cispo_hand_example():
    """Ratios e^1 = 2.718 (capped at 1.28) and e^-1 = 0.368 (kept: no lower cap), A = 1,
    token_sum_norm over length 2: loss = -(1.28 * lp_1 + 0.368 * lp_2) / 2, gradient
    (-0.64, -0.184): no token loses its gradient, unlike the clip."""
    lp = torch.tensor([[-1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    adv, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(lp, old, adv, mask, loss_mode="cispo", norm_length=2)
    w2 = math.exp(-1)
    assert abs(loss.item() - (-(1.28 * -1.0) - w2 * -3.0) / 2) < 1e-12
    assert m["clipfrac"].item() == 0.5
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.64, -w2 / 2]], dtype=torch.float64))


def test_sapo_hand_example():
    """r = e^0.5 with A = +1 (τ = 1) and with A = -1 (τ = 1.05), token_mean:
    l = -σ(τ(r-1)) 4/τ A; d l / d lp = -σ'(τ(r-1)) 4 r A."""
    r = math.exp(0.5)
    lp = torch.tensor([[0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="sapo", aggregation="token_mean")

    def sig(x):
        return 1 / (1 + math.exp(-x))

    want = (-sig(r - 1) * 4 + sig(1.05 * (r - 1)) * 4 / 1.05) / 2
    assert abs(loss.item() - want) < 1e-12
    loss.backward()
    d = [
        -sig(t * (r - 1)) * (1 - sig(t * (r - 1))) * 4 * r * a / 2
        for t, a in ((1.0, 1.0), (1.05, -1.0))
    ]
    assert torch.allclose(lp.grad, torch.tensor([d], dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("mode", ["clip", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("aggregation", ["token_sum_norm", "seq_mean_token_mean"])
def test_every_surrogate_has_ppos_gradient_at_ratio_one(mode, level, aggregation):
    """On policy (old = current) every mode and level gives -A ∇log π per token, reduced by
    the aggregation: they differ only off policy. (GSPO with per-token advantages does not:
    its gradient spreads each sequence's mean advantage over its tokens, so this uses
    per-sequence advantages.)"""
    lp, _, adv, mask, _ = make_inputs()
    base = lp.clone().requires_grad_()
    policy_loss(base, lp, adv, mask, aggregation=aggregation, norm_length=6)[0].backward()
    x = lp.clone().requires_grad_()
    loss, _ = policy_loss(
        x, lp, adv, mask, aggregation=aggregation, norm_length=6, loss_mode=mode, ratio_level=level
    )
    loss.backward()
    assert torch.allclose(x.grad, base.grad, atol=1e-12, rtol=0)


def test_high_entropy_mask_equals_trls():
    lp, old, adv, mask, ent = make_inputs(per_sequence=False)
    for q in (0.2, 0.5, 0.9):
        ours = high_entropy_mask(ent, mask, q)
        a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        ours_loss, _ = policy_loss(a, old, adv, mask, aggregation="token_mean", weights=ours)
        ours_loss = ours_loss - 0.1 * masked_aggregate(ent, ours.bool(), "token_mean")
        want = trl_loss(
            b,
            old,
            adv,
            mask,
            loss_type="bnpo",
            entropies=ent,
            top_entropy_quantile=q,
            entropy_coef=0.1,
        )
        assert abs(ours_loss.item() - want.item()) < 1e-12
        ours_loss.backward()
        want.backward()
        assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0)


def test_high_entropy_mask_hand_example():
    """Entropies 0.1, 0.4, 0.3, 0.2 (the last masked out): the pool is (0.1, 0.4, 0.3); the
    top third keeps entropies ≥ quantile(pool, 2/3) = 0.3 + (0.4 - 0.3) * (4/3 - 1) = 0.3333:
    only the 0.4. A pool from other ranks moves the threshold."""
    ent = torch.tensor([[0.1, 0.4, 0.3, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    assert high_entropy_mask(ent, mask, 1 / 3).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert high_entropy_mask(ent, mask, 1.0).tolist() == [[1.0, 1.0, 1.0, 0.0]]
    pool = torch.tensor([0.0, 0.0, 0.0, 0.1], dtype=torch.float64)
    assert high_entropy_mask(ent, mask, 0.5, pool=pool).tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_off_policy_mask_equals_trls():
    lp, old, adv, mask, _ = make_inputs(per_sequence=False)
    g = torch.Generator().manual_seed(3)
    sampling = old + torch.rand(old.shape, generator=g, dtype=torch.float64) * 0.4
    sampling[0, 1] = float("nan")
    for threshold in (0.0, 0.1, 0.3):
        keep = off_policy_sequence_mask(adv, lp, sampling, mask, threshold)
        a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        ours, _ = policy_loss(a, old, adv, mask, norm_length=6, weights=keep)
        want = trl_loss(
            b,
            old,
            adv,
            mask,
            loss_type="dr_grpo",
            max_completion_length=6,
            off_policy_mask_threshold=threshold,
            sampling_per_token_logps=sampling,
        )
        assert abs(ours.item() - want.item()) < 1e-12
        ours.backward()
        want.backward()
        assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0)


def test_off_policy_mask_hand_example():
    """Two sequences of two tokens, log μ − log π = (0.5, 0.1) and (0.05, 0.05): means 0.3 and
    0.05. With threshold 0.2 the first sequence's negative-advantage token is dropped, its
    zero-advantage one kept (A ≥ 0 keeps); the second sequence is close enough to keep both."""
    lp = torch.zeros(2, 2, dtype=torch.float64)
    sampling = torch.tensor([[0.5, 0.1], [0.05, 0.05]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 0.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    keep = off_policy_sequence_mask(adv, lp, sampling, mask, 0.2)
    assert keep.tolist() == [[0.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"loss_mode": "gspo"}, "unknown loss mode 'gspo'; expected one of clip, cispo, sapo"),
        ({"ratio_level": "seq"}, "expected one of token, sequence, sequence_token"),
        ({"loss_mode": "cispo", "dual_clip": 2.0}, "loss_mode 'cispo' has none"),
        ({"loss_mode": "sapo", "sapo_temperatures": (1.0, 0.0)}, "sapo temperature neg"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    lp, old, adv, mask, _ = make_inputs()
    with pytest.raises(ValueError, match=pattern):
        policy_loss(lp, old, adv, mask, norm_length=6, **kwargs)

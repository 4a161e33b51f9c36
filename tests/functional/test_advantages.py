"""Dr. GRPO and OPD advantages against per-sample loop references (float64)."""

import math

import pytest
import torch

from composer_lightning.functional import (
    dr_grpo_advantages,
    gdpo_advantages,
    grpo_advantages,
    opd_advantages,
)


def ref_dr_grpo(rewards, group_ids, has_reward):
    """Loop reference: per sample, scan the batch for rewarded members of its group."""
    out = []
    for r, g, h in zip(rewards, group_ids, has_reward, strict=True):
        if not h:
            out.append(0.0)
            continue
        members = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g and has_reward[j]]
        baseline = sum(members) / len(members) if len(members) > 1 else 0.0
        out.append(r - baseline)
    return out


def test_matches_loop_reference_with_arbitrary_group_ids():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([1000, -5, 1000, 7, -5, 7, 7, 1000, 42, -5, 99, 99], dtype=torch.long)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)
    has = torch.rand(12, generator=g) > 0.3
    has[10], has[11] = True, False  # group 99: one rewarded, one not -> baseline 0
    got = dr_grpo_advantages(rewards, ids, has)
    want = ref_dr_grpo(rewards.tolist(), ids.tolist(), has.tolist())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_group_sums_to_zero_and_unrewarded_exactly_zero():
    ids = torch.tensor([3, 3, 3, 3, 8, 8, 8])
    rewards = torch.tensor([1.0, 0.0, math.nan, 0.5, 2.0, math.inf, -1.0], dtype=torch.float64)
    has = torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.float64)  # 0/1 float mask
    adv = dr_grpo_advantages(rewards, ids, has)
    assert torch.isfinite(adv).all()
    assert adv[2].item() == 0.0 and adv[5].item() == 0.0
    for gid in (3, 8):
        sel = (ids == gid) & (has != 0)
        assert abs(adv[sel].sum().item()) < 1e-12
    # group 3 rewarded mean = 0.5 -> [0.5, -0.5, 0, 0]
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64))


def test_singleton_group_is_plain_reward_and_none_means_all():
    rewards = torch.tensor([0.3, -0.7, 1.0], dtype=torch.float64)
    ids = torch.tensor([0, 1, 2])
    torch.testing.assert_close(dr_grpo_advantages(rewards, ids), rewards, rtol=0, atol=0)
    ids = torch.tensor([5, 5, 9])
    all_true = torch.ones(3, dtype=torch.bool)
    assert torch.equal(dr_grpo_advantages(rewards, ids), dr_grpo_advantages(rewards, ids, all_true))


def test_no_std_division():
    """Group [0, 1, 1, 1]: mean 0.75, so A = [-0.75, .25, .25, .25] (GRPO would divide by .433)."""
    adv = dr_grpo_advantages(
        torch.tensor([0.0, 1, 1, 1], dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    )
    torch.testing.assert_close(adv, torch.tensor([-0.75, 0.25, 0.25, 0.25], dtype=torch.float64))


def test_empty_batch():
    out = dr_grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)


def test_dr_grpo_errors():
    with pytest.raises(ValueError, match=r"rewards \[3\] and group_ids \[2\]"):
        dr_grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"has_reward \[4\]"):
        dr_grpo_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match="float32"):
        dr_grpo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"\[3, 1\]"):
        dr_grpo_advantages(torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.long))


def test_opd_on_and_off_mask():
    teacher = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, math.inf, -3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, -1.0], [-0.25, -1.0, -math.inf]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    teacher.requires_grad_(True)
    adv = opd_advantages(teacher, old, mask)
    want = [[0.5, -1.0, 0.0], [-0.25, 0.0, 0.0]]
    assert adv.tolist() == want  # exact: off-mask is 0, not NaN * 0
    adv.sum().backward()
    assert teacher.grad.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert torch.equal(opd_advantages(teacher.detach(), old, mask.double()), adv.detach())


def test_opd_gap_clip_clamps_both_signs_on_the_mask_only():
    teacher = torch.tensor([[-30.0, -0.2, -1.0, 5.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -0.5, -4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    adv = opd_advantages(teacher, old, mask, gap_clip=1.0)
    assert adv.tolist() == [[-1.0, -0.2 - -0.5, 1.0, 0.0]]
    assert opd_advantages(teacher, old, mask).tolist() == [[-29.0, -0.2 - -0.5, 3.0, 0.0]]
    with pytest.raises(ValueError, match="gap_clip must be > 0 or None, got 0"):
        opd_advantages(teacher, old, mask, gap_clip=0)


def test_opd_sequence_centring_by_hand():
    """Row 0's gaps 0.5 and -1.0 have mean -0.25: centred 0.75 and -0.75; row 1's single gap
    centres to 0; off-mask stays exactly 0 (NaN and inf there included)."""
    teacher = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, math.inf, -3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, -1.0], [-0.25, -1.0, -math.inf]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert opd_advantages(teacher, old, mask, center="sequence").tolist() == [
        [0.75, -0.75, 0.0],
        [0.0, 0.0, 0.0],
    ]
    # after the clamp: [-1, 0.3, 1] has mean 0.1
    clipped = opd_advantages(
        torch.tensor([[-30.0, -0.2, -1.0, 5.0]], dtype=torch.float64),
        torch.tensor([[-1.0, -0.5, -4.0, 0.0]], dtype=torch.float64),
        torch.tensor([[1, 1, 1, 0]], dtype=torch.bool),
        gap_clip=1.0,
        center="sequence",
    )
    assert torch.allclose(clipped, torch.tensor([[-1.1, 0.2, 0.9, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="center must be None or 'sequence', got 'token'"):
        opd_advantages(teacher, old, mask, center="token")


def test_opd_sequence_centring_against_a_loop_reference():
    g = torch.Generator().manual_seed(0)
    teacher = -torch.rand(5, 9, generator=g, dtype=torch.float64) * 4
    old = -torch.rand(5, 9, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(5, 9, generator=g) < 0.6
    mask[3] = False  # a row without masked tokens: all zeros
    adv = opd_advantages(teacher, old, mask, gap_clip=1.5, center="sequence")
    for b in range(5):
        gaps = [max(-1.5, min(1.5, float(teacher[b, t] - old[b, t]))) for t in range(9)]
        on = [t for t in range(9) if mask[b, t]]
        mean = sum(gaps[t] for t in on) / len(on) if on else 0.0
        for t in range(9):
            want = gaps[t] - mean if mask[b, t] else 0.0
            assert abs(float(adv[b, t]) - want) < 1e-12
    assert torch.allclose(adv.sum(-1), torch.zeros(5, dtype=torch.float64), atol=1e-12)


def test_opd_shape_error():
    with pytest.raises(
        ValueError,
        match=r"teacher_logprobs \[2, 5\] and response_mask \[2, 4\] must have the same shape",
    ):
        opd_advantages(torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(2, 4))


def trl_scaled_advantages(rewards, group_ids, has_reward, scale_rewards):
    """TRL 1.16 `GRPOTrainer._generate_and_score_completions` (`sum_then_normalize`), its lines
    on NaN-marked rewards (unscorable samples are NaN; their advantage is then set to 0), for
    equal-size contiguous groups."""

    def nanstd(t, dim=None):  # trl.trainer.utils.nanstd
        mean = torch.nanmean(t, dim=dim, keepdim=True)
        variance = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
        count = torch.sum(~torch.isnan(t), dim=dim, keepdim=True)
        variance = variance * count / (count - 1)
        return torch.sqrt(variance).squeeze() if dim is None else torch.sqrt(variance).squeeze(dim)

    n = int(torch.bincount(group_ids).max())
    r = torch.where(has_reward, rewards, torch.full_like(rewards, math.nan))
    mean = torch.nanmean(r.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    if scale_rewards == "group":
        std = nanstd(r.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    else:
        std = nanstd(r).expand_as(r)
    adv = (r - mean) / (std + 1e-4)
    return torch.where(has_reward, adv, torch.zeros_like(adv))


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_scaled_advantages_equal_trls_definition(scale):
    g = torch.Generator().manual_seed(1)
    ids = torch.arange(6).repeat_interleave(4)  # 6 prompts x G = 4
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    has = torch.ones(24, dtype=torch.bool)
    has[[1, 6, 7, 13]] = False  # every group keeps >= 2 rewarded members
    got = grpo_advantages(rewards, ids, has, scale)
    want = trl_scaled_advantages(rewards, ids, has, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_scaled_advantages_by_hand():
    """Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3); group [2, 2]: std 0, so A = 0;
    a singleton rewarded group keeps A = R; "none" is Dr. GRPO."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 0.7], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    want = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.7], dtype=torch.float64)
    torch.testing.assert_close(
        grpo_advantages(rewards, ids, None, "group"), want, rtol=0, atol=1e-12
    )
    assert torch.equal(
        grpo_advantages(rewards, ids, None, "none"), dr_grpo_advantages(rewards, ids)
    )
    with pytest.raises(ValueError, match="scale_rewards must be 'group', 'batch' or 'none'"):
        grpo_advantages(rewards, ids, None, "std")


def trl_gdpo_advantages(rewards_per_func, reward_weights, num_generations):
    """TRL 1.16 `_generate_and_score_completions`, `multi_objective_aggregation=
    "normalize_then_sum"` (trl/trainer/grpo_trainer.py:2790-2810), for contiguous groups of
    `num_generations`; `nanstd` is trl.trainer.utils.nanstd."""

    def nanstd(tensor, dim=None, keepdim=False):
        mean = torch.nanmean(tensor, dim=dim, keepdim=True)
        variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
        # TRL divides integer counts (a float32 correction); in the tensor's dtype here
        count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True).to(tensor.dtype)
        correction = count / (count - 1)
        correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
        variance *= correction
        std = torch.sqrt(variance)
        if not keepdim:
            std = std.squeeze(dim) if dim is not None else std.squeeze()
        return std

    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    K = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, K)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = (
        nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    )
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, K)
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = (
        nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    )
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("G", [1, 4])
def test_gdpo_advantages_equal_trls(G):
    g = torch.Generator().manual_seed(5)
    comps = torch.rand(24, 3, generator=g, dtype=torch.float64)
    comps[:, 1] *= 10  # a function that spreads far more than the others
    comps[2, 0] = comps[9, 2] = comps[9, 1] = math.nan  # some functions gave no value
    comps[17] = math.nan  # no function scored this one
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    ids = torch.arange(24 // G).repeat_interleave(G)
    got = gdpo_advantages(comps, weights, ids)
    want = trl_gdpo_advantages(comps.clone(), weights, G)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got[17] == 0


def test_gdpo_hand_example_and_its_invariants():
    """One group of two, f1 = (1, 0), f2 = (5, 5): f1 normalises to ±0.5 / (√0.5 + 1e-4) = ±a,
    f2 (no spread) to 0; summed ±a, then over the batch ±a / (a√2 + 1e-4). A row without a
    reward gets 0 and leaves the statistics alone; an episode's rows count once."""
    comps = torch.tensor([[1.0, 5.0], [0.0, 5.0]], dtype=torch.float64)
    w = torch.ones(2, dtype=torch.float64)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    want = a / (a * math.sqrt(2) + 1e-4)
    got = gdpo_advantages(comps, w, torch.tensor([0, 0]))
    torch.testing.assert_close(
        got, torch.tensor([want, -want], dtype=torch.float64), rtol=0, atol=1e-12
    )
    more = torch.cat([comps, torch.tensor([[9.0, 9.0]], dtype=torch.float64)])
    got = gdpo_advantages(more, w, torch.tensor([0, 0, 0]), torch.tensor([True, True, False]))
    torch.testing.assert_close(
        got, torch.tensor([want, -want, 0.0], dtype=torch.float64), rtol=0, atol=1e-12
    )
    # the second episode has two turn rows: the same as one row each
    turns = torch.cat([comps, comps[1:]])
    got = gdpo_advantages(turns, w, torch.tensor([0, 0, 0]), episode_ids=torch.tensor([0, 1, 1]))
    torch.testing.assert_close(
        got, torch.tensor([want, -want, -want], dtype=torch.float64), rtol=0, atol=1e-12
    )
    with pytest.raises(ValueError, match=r"reward_weights has shape \(3,\); expected \(2,\)"):
        gdpo_advantages(comps, torch.ones(3, dtype=torch.float64), torch.tensor([0, 0]))

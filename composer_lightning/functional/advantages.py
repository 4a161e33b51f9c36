"""Advantage terms: Dr. GRPO group baselines (optionally std-scaled, TRL's `scale_rewards`) and
the OPD teacher advantage.

Each function returns one *term* of the mixed advantage; mixing, weights and broadcasting over
response tokens are the module's job.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_ndim, check_same_shape


def dr_grpo_advantages(
    rewards: Tensor,  # [N] float
    group_ids: Tensor,  # [N] long, arbitrary values; equal id = same prompt
    has_reward: Tensor | None = None,  # [N] bool or 0/1 float; None = all rewarded
) -> Tensor:  # [N]
    """Dr. GRPO advantages: reward minus the mean reward of the rewarded group members.

    `A_i = R_i - mean{R_j : j in group(i), has_reward_j}` with **no** division by the group
    standard deviation (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", https://arxiv.org/abs/2503.20783, Sec. 3.1). Samples without a reward get
    exactly 0 and stay out of the mean, so their (possibly NaN) reward values never matter. A
    group with a single rewarded member uses baseline 0 (A = R), as verl does for singleton
    groups (`compute_grpo_outcome_advantage`), so group size 1 is plain reward.

    Args:
        rewards: Per-sample scalar rewards.
        group_ids: Group (prompt) id of each sample; any integer values.
        has_reward: Whether each sample's reward is usable. None means all are.

    Returns:
        Per-sample advantages, same dtype as `rewards`.
    """
    check_ndim("rewards", rewards, (1,))
    check_same_shape(("rewards", rewards), ("group_ids", group_ids))
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if has_reward is None:
        rewarded = torch.ones_like(rewards, dtype=torch.bool)
    else:
        check_same_shape(("rewards", rewards), ("has_reward", has_reward))
        rewarded = as_bool_mask(has_reward)
    if rewards.numel() == 0:
        return rewards.clone()

    # torch.where, not multiplication: an unrewarded NaN must not reach the group sums.
    r = torch.where(rewarded, rewards, torch.zeros_like(rewards))
    _, group = torch.unique(group_ids, return_inverse=True)  # [N] in 0..G-1
    num_groups = int(group.max()) + 1
    sums = r.new_zeros(num_groups).index_add(0, group, r)  # [G]
    counts = r.new_zeros(num_groups).index_add(0, group, rewarded.to(r.dtype))  # [G]
    mean = sums / counts.clamp(min=1)
    baseline = torch.where(counts > 1, mean, torch.zeros_like(mean))[group]  # [N]
    return torch.where(rewarded, r - baseline, torch.zeros_like(r))


def grpo_advantages(
    rewards: Tensor,  # [N] float
    group_ids: Tensor,  # [N] long
    has_reward: Tensor | None = None,  # [N] bool or 0/1 float; None = all rewarded
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> Tensor:  # [N]
    """GRPO advantages with TRL's `scale_rewards`: the Dr. GRPO advantage divided by a reward
    standard deviation plus `eps`.

    `A_i = (R_i - mean_group(i)) / (std + eps)` where `std` is the unbiased (n − 1) standard
    deviation of the rewarded members of i's group (`"group"`, GRPO's original normalisation,
    Shao et al. 2024) or of every rewarded sample of the batch (`"batch"`, as TRL's
    `scale_rewards="batch"`); `"none"` is `dr_grpo_advantages` itself. This is TRL's
    `GRPOTrainer` (v1.16, `sum_then_normalize`: `nanstd`, `advantages / (std_rewards + 1e-4)`).
    Where TRL's statistics span all processes, here they span the rollout batch of one rank
    (its groups are whole). A group with one rewarded member keeps the Dr. GRPO value A = R
    (no standard deviation exists); unrewarded samples get exactly 0.

    Args:
        rewards, group_ids, has_reward: as `dr_grpo_advantages`.
        scale_rewards: "group", "batch" or "none".
        eps: added to the standard deviation (TRL: 1e-4).
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(
            f"scale_rewards must be 'group', 'batch' or 'none' (TRL's), got {scale_rewards!r}"
        )
    adv = dr_grpo_advantages(rewards, group_ids, has_reward)
    if scale_rewards == "none" or rewards.numel() == 0:
        return adv
    rewarded = (
        torch.ones_like(rewards, dtype=torch.bool)
        if has_reward is None
        else as_bool_mask(has_reward)
    )
    r = torch.where(rewarded, rewards, torch.zeros_like(rewards))
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1
    w = rewarded.to(r.dtype)
    counts = r.new_zeros(num_groups).index_add(0, group, w)
    if scale_rewards == "group":
        mean = r.new_zeros(num_groups).index_add(0, group, r) / counts.clamp(min=1)
        squares = r.new_zeros(num_groups).index_add(0, group, w * (r - mean[group]) ** 2)
        std = (squares / (counts - 1).clamp(min=1)).sqrt()[group]
    else:
        n = w.sum()
        mean = (w * r).sum() / n.clamp(min=1)
        std = ((w * (r - mean) ** 2).sum() / (n - 1).clamp(min=1)).sqrt().expand_as(r)
    scaled = counts[group] > 1
    return torch.where(rewarded & scaled, adv / (std + eps), adv)


def opd_advantages(
    teacher_logprobs: Tensor,  # [B, T]
    old_logprobs: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T] bool or 0/1 float
    gap_clip: float | None = None,
    center: str | None = None,
) -> Tensor:  # [B, T]
    """On-policy distillation advantage: teacher minus behaviour log-prob per sampled token.

    `A_t = teacher_logprobs_t - old_logprobs_t` on the mask, exactly 0 elsewhere (even where the
    inputs are NaN or inf there). The per-token reverse-KL reward of on-policy distillation
    (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes", https://arxiv.org/abs/2306.13649; Thinking Machines, "On-Policy
    Distillation", 2025). Fold `has_teacher` into the mask (`response_mask & has_teacher[:, None]`).
    The result is not detached; callers detach before using it as an advantage.

    Args:
        teacher_logprobs: Teacher log-probs of the sampled tokens.
        old_logprobs: Behaviour-policy log-probs of the same tokens.
        response_mask: Tokens that receive the term.
        gap_clip: clamp the gap to `[-gap_clip, gap_clip]` (> 0; OpenClaw-RL's top-k OPD clips
            it at 1.0): log-probs scale with 1 / temperature and a confident teacher gives gaps
            of tens of nats on a wrong token; None: no clamp.
        center: "sequence" subtracts each sequence's mean gap over its masked tokens (after the
            clamp), so every sequence's advantages sum to 0: the part of the signal that moves
            a whole reply alike (a hint that changes how the teacher would answer, not what)
            is removed and what stays is which tokens the teacher finds likelier than the rest
            of the same reply. The sample estimate of the reverse KL is <= 0 in expectation,
            so uncentred it pushes nearly every sampled reply down. None: no centring.

    Returns:
        The advantage term.
    """
    if gap_clip is not None and not gap_clip > 0:
        raise ValueError(f"gap_clip must be > 0 or None, got {gap_clip}")
    if center not in (None, "sequence"):
        raise ValueError(f"center must be None or 'sequence', got {center!r}")
    check_same_shape(
        ("teacher_logprobs", teacher_logprobs),
        ("old_logprobs", old_logprobs),
        ("response_mask", response_mask),
    )
    mask = as_bool_mask(response_mask)
    diff = teacher_logprobs - old_logprobs
    if gap_clip is not None:
        diff = diff.clamp(-gap_clip, gap_clip)
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    if center == "sequence":
        count = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        diff = torch.where(mask, diff - diff.sum(-1, keepdim=True) / count, torch.zeros_like(diff))
    return diff


def episode_advantages(
    rewards: Tensor,  # [N] float
    group_ids: Tensor,  # [N] long
    episode_ids: Tensor,  # [N] long; the rows (turns) of one episode share an id
    has_reward: Tensor | None = None,  # [N] bool or 0/1 float; None = all rewarded
    scale_rewards: str = "none",
    eps: float = 1e-4,
) -> Tensor:  # [N]
    """`grpo_advantages` of episodes whose turns are separate rows: each episode counts once in
    its group's statistics (however many turns it has) and every row of it gets the episode's
    advantage. With one row per episode this is `grpo_advantages` itself.

    Raises:
        ValueError: the rows of one episode disagree on their group, reward or `has_reward`.
    """
    check_same_shape(("rewards", rewards), ("episode_ids", episode_ids))
    if episode_ids.is_floating_point() or episode_ids.dtype == torch.bool:
        raise ValueError(f"episode_ids must be an integer tensor, got dtype {episode_ids.dtype}")
    if rewards.numel() == 0:
        return rewards.clone()
    rewarded = (
        torch.ones_like(rewards, dtype=torch.bool)
        if has_reward is None
        else as_bool_mask(has_reward)
    )
    _, episode = torch.unique(episode_ids, return_inverse=True)  # [N] in 0..E-1
    E = int(episode.max()) + 1
    first = torch.full((E,), rewards.numel(), dtype=torch.long, device=rewards.device)
    first = first.scatter_reduce(
        0, episode, torch.arange(rewards.numel(), device=rewards.device), "amin"
    )
    r = torch.where(rewarded, rewards, torch.zeros_like(rewards))
    for name, values in (("group_ids", group_ids), ("rewards", r), ("has_reward", rewarded)):
        if not torch.equal(values, values[first][episode]):
            raise ValueError(f"the rows of one episode must share their {name}")
    adv = grpo_advantages(r[first], group_ids[first], rewarded[first], scale_rewards, eps)
    return adv[episode]


def _nanstd(t: Tensor, dim: int | None = None) -> Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's `nanstd`); NaN with < 2 values."""
    mean = torch.nanmean(t, dim=dim, keepdim=True)
    variance = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(t)).sum(dim=dim, keepdim=True).to(t.dtype)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.nan)
    return variance.sqrt().squeeze() if dim is None else variance.sqrt().squeeze(dim)


def gdpo_advantages(
    components: Tensor,  # [N, K] each reward function's value; NaN where it gave none
    reward_weights: Tensor,  # [K]
    group_ids: Tensor,  # [N] long
    has_reward: Tensor | None = None,  # [N] bool or 0/1 float; None = all rewarded
    episode_ids: Tensor | None = None,  # [N] long; rows of one episode share an id
    eps: float = 1e-4,
) -> Tensor:  # [N]
    """GDPO's advantages (Liu et al. 2026, "Group reward-Decoupled Normalization Policy
    Optimization", https://arxiv.org/abs/2601.05242; TRL 1.16 `multi_objective_aggregation=
    "normalize_then_sum"`): each reward function's values are normalised within the group,
    `(r_k − mean_k) / (std_k + eps)` (NaN-aware, unbiased std; 0 for a group of one), summed
    with the weights (a NaN counts 0), then normalised over the batch, `(R − mean) / (std +
    eps)`. A row no function scored, or without a reward, gets exactly 0.

    So a function whose values spread widely cannot drown one that spreads little, as it does
    when the weighted rewards are summed first. Each episode (`episode_ids`) counts once, its
    rows sharing its advantage (its rows carry the same components). The batch here is the
    rollout batch of one rank, as `grpo_advantages`'s `"batch"`.
    """
    check_ndim("components", components, (2,))
    N, K = components.shape
    check_same_shape(("group_ids", group_ids), ("components[:, 0]", components[:, 0]))
    if tuple(reward_weights.shape) != (K,):
        raise ValueError(
            f"reward_weights has shape {tuple(reward_weights.shape)}; expected {(K,)} (one per "
            "column of components)"
        )
    if N == 0:
        return components.new_zeros(0)
    rewarded = (
        torch.ones(N, dtype=torch.bool, device=components.device)
        if has_reward is None
        else as_bool_mask(has_reward)
    )
    ids = torch.arange(N, device=components.device) if episode_ids is None else episode_ids
    _, episode = torch.unique(ids, return_inverse=True)  # [N] in 0..E-1
    E = int(episode.max()) + 1
    first = torch.full((E,), N, dtype=torch.long, device=components.device)
    first = first.scatter_reduce(0, episode, torch.arange(N, device=components.device), "amin")
    c = components[first].to(reward_weights.dtype)  # [E, K]
    c = torch.where(rewarded[first, None], c, torch.full_like(c, math.nan))
    groups = group_ids[first]
    normalised = torch.full_like(c, math.nan)
    for g in torch.unique(groups):
        rows = groups == g
        sub = c[rows]  # [n_g, K]
        std = _nanstd(sub, dim=0) if len(sub) > 1 else torch.zeros_like(sub[0])
        normalised[rows] = (sub - torch.nanmean(sub, dim=0, keepdim=True)) / (std + eps)
    summed = (normalised * reward_weights).nansum(dim=1)  # [E]
    summed = torch.where(torch.isnan(c).all(dim=1), torch.nan, summed)
    std = _nanstd(summed) if E > 1 else torch.zeros((), dtype=summed.dtype)
    adv = torch.nan_to_num((summed - torch.nanmean(summed)) / (std + eps), nan=0.0)
    return adv[episode]

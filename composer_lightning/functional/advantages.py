"""Advantage terms: Dr. GRPO group baselines and the OPD teacher advantage.

Each function returns one *term* of the mixed advantage; mixing, weights and broadcasting over
response tokens are the module's job.
"""

from __future__ import annotations

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


def opd_advantages(
    teacher_logprobs: Tensor,  # [B, T]
    old_logprobs: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T] bool or 0/1 float
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

    Returns:
        The advantage term.
    """
    check_same_shape(
        ("teacher_logprobs", teacher_logprobs),
        ("old_logprobs", old_logprobs),
        ("response_mask", response_mask),
    )
    mask = as_bool_mask(response_mask)
    diff = teacher_logprobs - old_logprobs
    return torch.where(mask, diff, torch.zeros_like(diff))

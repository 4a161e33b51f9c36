"""Top-k on-policy distillation with overlap-guided hint selection (OpenClaw-RL's top-k OPD).

Sampled-token OPD (`opd_advantages`) only scores the token the student drew: it can say "not
this token" but cannot name the right one when the student never samples it. Top-k OPD spreads
the teacher's signal over a small vocabulary subset per position, including tokens the student
did not sample. Per response token t, with global log-probs at the sampling temperature (never
renormalised on a subset):
`ℓ_old` the policy before the rollout batch's first update (no grad), `ℓ_θ` the current policy
(grad), `ℓ_c` the teacher given candidate hint c (no grad); the candidates come shortest first.

- overlap: `o_{c,t} = |top-k(π_old) ∩ top-k(π_c)|`.
- selection: `sequence_optimal` picks per sample the candidate with the largest `Σ_t o_{c,t}`;
  `token_optimal` picks per token the candidate with the largest `o_{c,t}`; `shortest` the first
  (shortest) candidate. Ties go to the shorter candidate.
- subset `S_t`: `student` = top-k(π_old); `teacher` = top-k(π_c*); `overlap` = their
  intersection (a token with an empty intersection has no term).
- weight `w_v = softmax_{v ∈ S_t}(ℓ_old(v))` (detached, the only subset normalisation); gap
  `g_v = clamp(ℓ_c*(v) − ℓ_old(v), −gap_clip, gap_clip)`; advantage `A_v = w_v · g_v`.
- ratio `ρ_v = exp(ℓ_θ(v) − ℓ_old(v))`; `L_v = max(−A_v ρ_v, −A_v clip(ρ_v, 1 − ε_low,
  1 + ε_high))`; the token's loss is `L_t = Σ_{v ∈ S_t} L_v` (a sum: the weights already sum to
  1 over the subset).

References: Gen-Verse/OpenClaw-RL, `openclaw-combine/README.md` (top-k OPD, k = 4, subset modes,
hint selection, the gap clip at 1.0) and its `hint_opd_loss.py` (`_opd_one_sample`: global
ratios, subset-normalised old-policy weights, sum over the subset). Here the token losses are
reduced by the module's aggregation, like every other term.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

from ._checks import check_choice, check_range, shape_str
from .logprobs import scaled_logits
from .vocab_tiles import tiled_logprobs

SELECTIONS = ("sequence_optimal", "token_optimal", "shortest")
SUBSETS = ("student", "teacher", "overlap")


@overload
def topk_from_hidden(
    hidden: Tensor, weight: Tensor, k: int, temperature: float, chunk_size: int, at: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...
@overload
def topk_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    temperature: float,
    chunk_size: int,
    at: None = None,
) -> tuple[Tensor, Tensor, None, Tensor]: ...
@torch.no_grad()
def topk_from_hidden(
    hidden: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    k: int,
    temperature: float,
    chunk_size: int,
    at: Tensor | None = None,  # [N, K'] long
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:  # [N, k], [N, k], [N, K'], [N]
    """The top-`k` ids and global log-probs of `softmax(hidden @ weight.T / temperature)`, the
    log-probs at the ids `at`, and the log-normaliser, a chunk of tokens at a time (no grad;
    no `[N, V]` tensor outlives a chunk). Ties between equal log-probs go to the lower id."""
    check_range("temperature", temperature, 0.0)
    ids, lps, ats, lses = [], [], [], []
    for i in range(0, hidden.shape[0], chunk_size):
        x = scaled_logits(hidden[i : i + chunk_size] @ weight.T, temperature)  # [n, V]
        lse = torch.logsumexp(x, dim=-1)
        lp = x - lse[:, None]
        top = _stable_topk(lp, k)
        ids.append(top)
        lps.append(lp.gather(-1, top))
        lses.append(lse)
        if at is not None:
            ats.append(lp.gather(-1, at[i : i + chunk_size]))
    n, dtype = hidden.shape[0], scaled_logits(hidden[:0, :0], temperature).dtype
    if n == 0:
        empty = torch.zeros(0, k, dtype=dtype, device=hidden.device)
        out_at = None if at is None else torch.zeros(0, at.shape[1], dtype=dtype)
        return empty.long(), empty, out_at, torch.zeros(0, dtype=dtype, device=hidden.device)
    return (
        torch.cat(ids),
        torch.cat(lps),
        None if at is None else torch.cat(ats),
        torch.cat(lses),
    )


def _stable_topk(lp: Tensor, k: int) -> Tensor:
    """Top-k column ids per row, ties to the lower id (a stable descending sort)."""
    return torch.sort(lp, dim=-1, descending=True, stable=True).indices[:, :k]


@torch.no_grad()
def logprobs_at_given_lse(
    hidden: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    ids: Tensor,  # [N, K] long
    lse: Tensor,  # [N] the log-normaliser of the same rows (`topk_from_hidden`)
    temperature: float,
) -> Tensor:  # [N, K]
    """Global log-probs at `ids` from the rows' known log-normaliser: `K` dot products per
    token, no vocabulary pass (no grad)."""
    logits = torch.einsum("nh,nkh->nk", hidden, weight[ids])
    return scaled_logits(logits, temperature) - lse[:, None]


def chunked_logprobs_at(
    hidden: Tensor,  # [N, H] (grad)
    weight: Tensor,  # [V, H] (grad)
    ids: Tensor,  # [N, K] long
    temperature: float,
    chunk_size: int,
) -> Tensor:  # [N, K]
    """Global log-probs of `softmax(hidden @ weight.T / temperature)` at `ids`, with grad, in
    recomputed vocabulary tiles of about `chunk_size` x V logits (`vocab_tiles.py`)."""
    if hidden.shape[0] != ids.shape[0]:
        raise ValueError(f"ids {shape_str(ids)} must have a row per hidden row {shape_str(hidden)}")
    return tiled_logprobs(hidden, weight, ids, temperature, chunk_size * weight.shape[0])


def candidate_overlap(
    student_ids: Tensor,  # [..., K]
    candidate_ids: Tensor,  # [..., C, K]
) -> Tensor:  # [..., C]
    """`|student_ids ∩ candidate_ids[c]|` per position and candidate (ids within a row are
    distinct, as top-k ids are)."""
    same = student_ids[..., None, :, None] == candidate_ids[..., :, None, :]  # [..., C, K, K]
    return same.any(dim=-1).sum(dim=-1)


def select_candidates(
    overlap: Tensor,  # [B, C, T]
    available: Tensor,  # [B, C] bool
    mask: Tensor,  # [B, T] bool, the tokens that count
    rule: str,
) -> Tensor:  # [B, T] long
    """The selected candidate per token (see the module docstring); an unavailable candidate is
    never selected while the sample has an available one (a sample without one gets 0)."""
    check_choice("selection", rule, SELECTIONS)
    B, C, T = overlap.shape
    if rule == "shortest":
        first = torch.argmax(available.int(), dim=1)  # the first available: the shortest
        return first[:, None].expand(B, T)
    score = torch.where(mask[:, None, :], overlap, torch.zeros_like(overlap)).to(torch.long)
    if rule == "sequence_optimal":
        total = torch.where(available, score.sum(dim=2), torch.full_like(score[:, :, 0], -1))
        return torch.argmax(total, dim=1)[:, None].expand(B, T)  # first maximum: the shorter
    per_token = torch.where(available[:, :, None], score, torch.full_like(score, -1))
    return torch.argmax(per_token, dim=1)


def topk_opd_per_token(
    logprobs: Tensor,  # [N, K] ℓ_θ at the subset ids (grad)
    old_logprobs: Tensor,  # [N, K] ℓ_old at the same ids
    teacher_logprobs: Tensor,  # [N, K] ℓ_c* at the same ids
    subset: Tensor,  # [N, K] bool, the ids in S_t
    *,
    gap_clip: float | None = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:  # [N], metrics
    """Per-token top-k OPD loss `L_t = Σ_{v ∈ S_t} L_v` (module docstring), 0 where `S_t` is
    empty, and detached metrics: `gap_abs` (Σ_v w_v |g_v| per token, mean), `subset_size`
    (mean |S_t|), `clipfrac` (the share of (t, v) pairs whose ratio is clipped) and `adv_mean`
    (mean of Σ_v A_v)."""
    if gap_clip is not None:
        check_range("gap_clip", gap_clip, 0.0)
    for name, t in (("old_logprobs", old_logprobs), ("teacher_logprobs", teacher_logprobs)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} {shape_str(t)} must match logprobs {shape_str(logprobs)}")
    if subset.shape != logprobs.shape:
        raise ValueError(f"subset {shape_str(subset)} must match logprobs {shape_str(logprobs)}")
    old, teacher = old_logprobs.detach(), teacher_logprobs.detach()
    neg = torch.finfo(old.dtype).min
    w = torch.softmax(torch.where(subset, old, torch.full_like(old, neg)), dim=-1)
    w = torch.where(subset, w, torch.zeros_like(w))  # an empty row: all zero
    gap = teacher - old
    if gap_clip is not None:
        gap = gap.clamp(-gap_clip, gap_clip)
    adv = w * gap  # [N, K]
    log_ratio = (logprobs - old).clamp(-20.0, 20.0)  # as `policy_loss`
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_pair = torch.maximum(-adv * ratio, -adv * clipped)
    per_pair = torch.where(subset, per_pair, torch.zeros_like(per_pair))
    per_token = per_pair.sum(dim=-1)
    with torch.no_grad():
        rows = subset.any(dim=-1)
        n = rows.sum().clamp(min=1)
        pairs = subset.sum().clamp(min=1)
        metrics = {
            "gap_abs": (w * gap.abs()).sum(-1).sum() / n,
            "subset_size": subset.sum(-1).float().sum() / n,
            "clipfrac": ((-adv * clipped > -adv * ratio) & subset).sum() / pairs,
            "adv_mean": adv.sum(-1).sum() / n,
        }
    return per_token, metrics

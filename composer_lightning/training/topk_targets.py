"""The no-grad top-k values of a rollout batch for top-k OPD: one teacher forward per candidate.

Computed once per rollout batch before its first update, like the other rollout targets
(`targets.rollout_targets`): the policy as it sampled (π_old) gives the top-k ids and log-probs
of every response token; each candidate hint's teacher forward gives its own top-k, its
log-probs at π_old's top-k ids and π_old's log-probs at its top-k ids (all global log-probs at
the sampling temperature). The LM head runs on chunks of tokens: no `[B, T, V]` tensor.

Every rank runs the same forwards: the candidate count is agreed over ranks (a rank with fewer
candidates runs one-token placeholders), and the micro-batches follow the step's plan (the
teacher plan for the candidates).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from composer_lightning.functional.align import teacher_alignment
from composer_lightning.functional.logprobs import upcast
from composer_lightning.functional.topk_opd import logprobs_at_given_lse, topk_from_hidden
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import TopKTargets
from composer_lightning.runtime.distributed import StepMetrics, agree
from composer_lightning.training.hidden import final_hidden
from composer_lightning.training.microbatch import Plan


def agreed_candidates(rb: RolloutBatch) -> int:
    """The largest candidate count of any rank's batch (a collective with several ranks)."""
    counts = StepMetrics()
    counts.max(
        "candidates", 0 if rb.candidate_input_ids is None else rb.candidate_input_ids.shape[1]
    )
    return int(agree(counts)["candidates"])


def _states(model: nn.Module, ids: Tensor, attn: Tensor) -> tuple[Tensor, Tensor]:
    states, weight = final_hidden(model, ids, attn)
    return upcast(states), upcast(weight)


def _pieces(mb: RolloutBatch, plan: Plan | None, which: str):
    if plan is None:
        yield torch.arange(mb.batch_size, device=mb.input_ids.device), mb
    else:
        yield from plan.pieces(mb, which)


def _candidate_view(mb: RolloutBatch, c: int) -> RolloutBatch:
    """`mb` with candidate `c`'s teacher context in the teacher fields."""
    assert mb.candidate_input_ids is not None and mb.candidate_attention_mask is not None
    assert mb.candidate_positions is not None and mb.has_candidate is not None  # `have` > c
    return replace(
        mb,
        teacher_input_ids=mb.candidate_input_ids[:, c],
        teacher_attention_mask=mb.candidate_attention_mask[:, c],
        teacher_positions=mb.candidate_positions[:, c],
        has_teacher=mb.has_candidate[:, c],
    )


@torch.no_grad()
def topk_targets(
    policy: nn.Module,
    teacher: nn.Module | None,
    mb: RolloutBatch,
    k: int,
    candidates: int,
    temperature: float,
    chunk_size: int,
    plan: Plan | None = None,
) -> TopKTargets:
    """The top-k values of one minibatch `mb` (see the module docstring).

    Args:
        policy: the policy before the batch's first update. teacher: a frozen teacher, or None
            (the policy on the hinted contexts).
        k: top-k size. candidates: the agreed candidate count C (`agreed_candidates`).
        temperature: the sampling temperature. chunk_size: tokens per LM-head chunk.
        plan: the minibatch's micro-batches, or None (one forward each).
    """
    B, T = mb.input_ids.shape
    dev = mb.input_ids.device
    if candidates == 0:  # no rank has a candidate hint: nothing to run
        z = torch.zeros(B, 0, T, k, device=dev)
        return TopKTargets(
            torch.zeros(B, T, k, dtype=torch.long, device=dev),
            torch.zeros(B, T, k, device=dev),
            z.long(),
            z,
            z,
            z,
            torch.zeros(B, 0, dtype=torch.bool, device=dev),
        )
    old_ids = torch.zeros(B, T, k, dtype=torch.long, device=dev)
    old_lp: Tensor | None = None
    old_lse: Tensor | None = None
    old_hidden: Tensor | None = None
    tokens = mb.response_mask.clone()
    tokens[:, 0] = False  # position 0 predicts nothing
    for rows, sub in _pieces(mb, plan, "student"):
        states, weight = _states(policy, sub.input_ids, sub.attention_mask)
        if rows is None:
            continue
        w = sub.input_ids.shape[1]
        if old_hidden is None:
            old_hidden = states.new_zeros(B, T, states.shape[-1])
            old_lp, old_lse = states.new_zeros(B, T, k), states.new_zeros(B, T)
        assert old_lp is not None and old_lse is not None  # made with old_hidden
        old_hidden[rows, 1:w] = states[:, : w - 1]
        sel = tokens[rows, :w]
        ids, lp, _, lse = topk_from_hidden(
            states[:, : w - 1][sel[:, 1:]], weight, k, temperature, chunk_size
        )
        old_ids[rows, :w] = old_ids[rows, :w].masked_scatter(sel[..., None], ids)
        old_lp[rows, :w] = old_lp[rows, :w].masked_scatter(sel[..., None], lp)
        old_lse[rows, :w] = old_lse[rows, :w].masked_scatter(sel, lse)
    policy_weight = weight.clone()  # FSDP2 may free the gathered weight at the next forward
    shape = (B, candidates, T, k)
    t_ids = torch.zeros(shape, dtype=torch.long, device=dev)
    dtype = old_hidden.dtype if old_hidden is not None else torch.float32
    if old_hidden is None:  # every piece a placeholder (a rank without rows)
        old_lp, old_lse = torch.zeros(B, T, k, device=dev), torch.zeros(B, T, device=dev)
    assert old_lp is not None and old_lse is not None  # made with old_hidden, or just above
    t_lp, t_at_old, old_at_t = (torch.zeros(shape, dtype=dtype, device=dev) for _ in range(3))
    aligned = torch.zeros(B, candidates, dtype=torch.bool, device=dev)
    have = 0 if mb.candidate_input_ids is None else mb.candidate_input_ids.shape[1]
    for c in range(candidates):
        if c >= have:  # this rank has no candidate c: placeholders keep the collectives in step
            for _ in _pieces(mb, plan, "teacher"):
                _states(teacher or policy, mb.input_ids[:1, :1], mb.attention_mask[:1, :1])
            continue
        view = _candidate_view(mb, c)
        for rows, sub in _pieces(view, plan, "teacher"):
            ids_c, attn_c = sub.teacher_input_ids, sub.teacher_attention_mask
            states, weight = _states(teacher or policy, ids_c, attn_c)
            if rows is None:
                continue
            w = sub.input_ids.shape[1]
            pos = sub.teacher_positions[:, :w]
            valid = (pos >= 1) & (pos < ids_c.shape[1])
            sel = tokens[rows, :w] & valid & sub.has_teacher[:, None]
            src = (pos - 1).clamp(min=0)[sel]  # the teacher row predicting each selected token
            batch_row = torch.arange(len(rows), device=dev)[:, None].expand_as(pos)[sel]
            ids, lp, at_old, _ = topk_from_hidden(
                states[batch_row, src],
                weight,
                k,
                temperature,
                chunk_size,
                at=old_ids[rows, :w][sel],
            )
            assert old_hidden is not None  # these rows ran in the student pass
            at_t = logprobs_at_given_lse(
                old_hidden[rows, :w][sel], policy_weight, ids, old_lse[rows, :w][sel], temperature
            )
            for out, value in ((t_ids, ids), (t_lp, lp), (t_at_old, at_old), (old_at_t, at_t)):
                block = out[rows, c, :w]
                out[rows, c, :w] = block.masked_scatter(sel[..., None], value)
            required = sub.response_mask & sub.has_teacher[:, None]
            aligned[rows, c] = sub.has_teacher & teacher_alignment(
                sub.input_ids, ids_c, sub.teacher_positions, required
            )
    return TopKTargets(old_ids, old_lp, t_ids, t_lp, t_at_old, old_at_t, aligned)

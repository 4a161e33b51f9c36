"""The no-grad targets of a rollout batch: old, reference and teacher values, once.

Computed before the batch's first update and shared by all its updates (`RolloutTargets`):
the old log-probs (a recompute when there is more than one update), the reference log-probs,
ONE teacher forward on the hinted contexts (OPD's teacher log-probs, SDPO's teacher hidden
states) and top-k OPD's top-k values (`topk_targets.py`). A teacher recomputed from the already
updated policy would drift (OpenClaw takes the teacher at sampling time). This module is the
one owner of the targets: it calls down to the forwards (`forward.py`, `topk_targets.py`,
`hidden.py`) and the micro-batch plan, none of which calls back.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from composer_lightning.functional import chunked_logprobs_from_hidden
from composer_lightning.functional.align import teacher_alignment
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import RolloutTargets, TopKTargets
from composer_lightning.training.forward import Forwards, by_piece, response_logprobs, teacher_view
from composer_lightning.training.hidden import chunk_tokens, final_hidden
from composer_lightning.training.microbatch import Plan
from composer_lightning.training.topk_targets import agreed_candidates, topk_targets

_TEACHER = frozenset({"teacher_logprobs", "teacher_hidden", "teacher_logits"})
_TEACHER_HIDDEN = frozenset({"teacher_hidden", "teacher_logits"})


@torch.no_grad()
def rollout_targets(
    f: Forwards,
    rb: RolloutBatch,
    needs: set[str],
    splits: list[Tensor] | None = None,
    updates: int = 1,
    plans: list[Plan] | None = None,
    behavior_logprobs: Tensor | None = None,
) -> RolloutTargets:
    """The no-grad values of a rollout batch, computed once before its first update.

    Forwards run per minibatch `splits`, and per micro-batch of each with `plans` (bounding
    activation memory); every rank runs the same forwards whatever its data (a teacher forward
    runs on a one-token placeholder when the batch has no hinted context; a micro-batch
    placeholder where a rank has fewer), so FSDP2's collectives always match.

    Args:
        f: the models and settings; a teacher None is the live policy.
        rb: the rollout batch.
        needs: the union of the active heads' `requires` over this batch's updates.
        splits: the row indices of its minibatches (None: one).
        updates: the optimizer steps this batch makes; with more than one the old log-probs
            are recomputed and the live policy's LM head is copied for the teacher (it changes
            before the last update reads the teacher hidden states).
        plans: each minibatch's micro-batches (`microbatch.plans`); None: one forward each.
        behavior_logprobs: a stale batch's behaviour log-probs (the engine's), kept as they are.
    """
    policy, teacher, reference = f.policy, f.teacher, f.reference
    temperature, chunk_size = f.temperature, f.chunk_size
    old = snapshot_teacher_head = updates > 1
    B, T = rb.input_ids.shape
    if splits is None:
        splits = [torch.arange(B, device=rb.input_ids.device)]
    parts: dict[str, list[tuple[Tensor, Tensor]]] = {}
    topk: list[tuple[Tensor, TopKTargets]] = []
    head_weight = None
    want_teacher, want_hidden = bool(needs & _TEACHER), bool(needs & _TEACHER_HIDDEN)
    want_topk = "teacher_topk" in needs and f.topk > 0
    candidates = agreed_candidates(rb) if want_topk else 0
    scored = [("old_logprobs", policy)] if old else []
    if "ref_logprobs" in needs:
        assert reference is not None  # built for the heads that read it (reference_model)
        scored.append(("ref_logprobs", reference))
    for n, idx in enumerate(splits):
        mb, plan = rb.select(idx), None if plans is None else plans[n]
        for key, model in scored:

            def logprobs(sub: RolloutBatch, model: nn.Module = model) -> dict[str, Tensor]:
                return {"lp": response_logprobs(model, sub, temperature, chunk_size)}

            parts.setdefault(key, []).append((idx, by_piece(mb, plan, "student", logprobs)["lp"]))
        if want_teacher:

            def teacher_values(sub: RolloutBatch) -> dict[str, Tensor]:
                nonlocal head_weight
                lp, hidden, aligned, head_weight = _teacher(
                    sub, teacher or policy, temperature, chunk_size
                )
                return {"lp": lp, "aligned": aligned} | ({"hidden": hidden} if want_hidden else {})

            values = by_piece(mb, plan, "teacher", teacher_values)
            parts.setdefault("teacher_logprobs", []).append((idx, values["lp"]))
            parts.setdefault("teacher_aligned", []).append((idx, values["aligned"]))
            if want_hidden:
                parts.setdefault("teacher_hidden", []).append((idx, values["hidden"]))
        if want_topk:
            topk.append(
                (
                    idx,
                    topk_targets(
                        policy,
                        teacher,
                        mb,
                        f.topk,
                        candidates,
                        temperature,
                        chunk_tokens(policy.get_output_embeddings().weight, chunk_size),  # type: ignore[operator]
                        plan,
                    ),
                )
            )
    head = None
    if want_hidden and (teacher is not None or snapshot_teacher_head):
        assert head_weight is not None  # the teacher forward ran (want_hidden: want_teacher)
        head = head_weight.detach().clone() if teacher is None else head_weight
    return RolloutTargets(
        **{k: _assemble(v, B) for k, v in parts.items()},
        teacher_lm_head_weight=head,
        behavior_logprobs=behavior_logprobs,
        teacher_topk=None
        if not topk
        else TopKTargets(*(_assemble([(i, t[j]) for i, t in topk], B) for j in range(7))),
    )


def _teacher(
    mb: RolloutBatch, model: nn.Module, temperature: float, chunk_size: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ONE teacher forward on the hinted contexts, mapped into the student layout."""
    B, T = mb.input_ids.shape
    if mb.teacher_input_ids is None:  # nothing hinted: a placeholder keeps collectives in step
        ids, attn = mb.input_ids[:1, :1], mb.attention_mask[:1, :1]
    else:
        assert mb.teacher_attention_mask is not None  # given with teacher_input_ids
        ids, attn = mb.teacher_input_ids, mb.teacher_attention_mask
    states, weight = final_hidden(model, ids, attn)  # [b, T', H]
    if mb.teacher_input_ids is None:
        zeros = states.new_zeros(B, T)
        return (
            zeros,
            states.new_zeros(B, T, states.shape[-1]),
            torch.zeros(B, dtype=torch.bool, device=zeros.device),
            weight,
        )
    assert mb.teacher_positions is not None  # given with teacher_input_ids
    assert mb.has_teacher is not None and mb.sdpo_mask is not None  # __post_init__
    lp_own = chunked_logprobs_from_hidden(
        states,
        weight,
        ids,
        temperature,
        chunk_tokens(weight, chunk_size),
        mask=_mapped(mb.teacher_positions, ids.shape[1]),
    )  # [B, T']
    lp, hidden, _ = teacher_view(states, lp_own, mb.teacher_positions)
    required = (mb.response_mask & mb.has_teacher.unsqueeze(1)) | mb.sdpo_mask
    aligned = teacher_alignment(mb.input_ids, ids, mb.teacher_positions, required)
    return lp, hidden, aligned, weight


def _mapped(teacher_positions: Tensor, width: int) -> Tensor:
    """`[B, T']` bool: the teacher positions some student token maps to (1 <= p < T')."""
    valid = (teacher_positions >= 1) & (teacher_positions < width)  # [B, T]
    out = torch.zeros(
        teacher_positions.shape[0], width, dtype=torch.bool, device=teacher_positions.device
    )
    return out.scatter_(1, torch.where(valid, teacher_positions, 0), valid)  # p = 0 is never valid


def _assemble(parts: list[tuple[Tensor, Tensor]], B: int) -> Tensor:
    """Scatter per-minibatch rows back into one `[B, ...]` tensor."""
    first = parts[0][1]
    out = first.new_zeros((B, *first.shape[1:]))
    for idx, value in parts:
        out[idx] = value
    return out

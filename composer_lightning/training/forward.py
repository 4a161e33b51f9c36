"""Model forwards without `[B, T, V]` logits: per-token log-probs, entropies and hidden states.

A forward returns the final hidden states (after the last norm); the LM head is applied to them
in checkpointed chunks of tokens (`functional.chunked`), so peak memory grows with the chunk,
not with T x V.

FSDP2: the forward is a call of the model's root module, so the root's parameters (embeddings,
final norm, LM head) are all-gathered by FSDP2's pre-forward hook and, as FSDP2 does for the
root by default (`reshard_after_forward=None`), stay unsharded until the backward is done. The
LM head weight read after the forward is therefore the full weight, its chunks' gradients
accumulate into it, and FSDP2's post-backward reduce-scatters them with the rest of the root's.
A frozen model (reference, separate teacher) reshards its root right after the forward
(`models.sharding.shard_frozen`): its LM head is gathered whole for the chunks, without grad.

The models are HF-style causal LMs: `get_output_embeddings()` (an LM head without bias) and
`output_hidden_states` (the last entry is the final, normed hidden state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from composer_lightning.functional import (
    chunked_entropy_from_hidden,
    chunked_logprobs_from_hidden,
)
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import RolloutTargets, StepContext
from composer_lightning.training.hidden import chunk_tokens, final_hidden
from composer_lightning.training.microbatch import Plan


@dataclass
class TokenScores:
    """One forward's per-token outputs, aligned with `input_ids` (column t describes token t).

    Attributes:
        logprobs: `[B, T]` log-probs of the sampling distribution (column 0 is 0).
        entropy: `[B, T]` entropies of the distributions predicting each token, or None.
        hidden: `[B, T, H]` row t is the hidden state that predicts token t (row 0 zeros), or
            None.
        lm_head_weight: `[V, H]` the LM head the logits are `hidden @ lm_head_weight.T` of.
        states: `[B, T, H]` the final hidden states all of the above are computed from (row t
            predicts token t + 1), where a gradient taken at them reaches every output; None
            for a micro-batched step's per-token leaves (`accumulate.py`).
    """

    logprobs: Tensor
    entropy: Tensor | None
    hidden: Tensor | None
    lm_head_weight: Tensor
    states: Tensor | None = None


def score_tokens(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float,
    mask: Tensor | None = None,
    entropy: bool = False,
    hidden: bool = False,
    chunk_size: int | None = None,
    final: tuple[Tensor, Tensor] | None = None,
) -> TokenScores:
    """Per-token log-probs (and entropies, hidden states) of `input_ids` under `model`.

    Args:
        model: an HF-style causal LM (see the module docstring).
        input_ids: `[B, T]` token ids. attention_mask: `[B, T]`.
        temperature: the sampling temperature (log-probs of `logits / temperature`).
        mask: `[B, T]` the tokens whose log-probs (entropies) are computed, e.g. the response
            tokens; the others are 0 and cost no LM-head work. None: every token.
        entropy: also compute entropies. hidden: also return the shifted hidden states.
        chunk_size: tokens per LM-head chunk; None: ≈ 8 MiB of fp32 logits per chunk on CPU (64 MiB on an
            accelerator), at least H / 8 tokens.
        final: `([B, T, H] final hidden states, [V, H] LM head)` to score instead of running
            `model` (a micro-batched step's states kept as leaves, `accumulate.py`).
    """
    if final is None:
        states, weight = final_hidden(model, input_ids, attention_mask)
        # a node of its own: a gradient taken at `states` (`functional/gradients.py`) stops
        # here, short of the model's backward hooks on its outputs (FSDP2's pre-backward ones,
        # which, run by a measurement, break the step's backward: tests/scale/test_grad_share)
        states = states.view_as(states)
    else:
        states, weight = final
    chunk = chunk_tokens(weight, chunk_size)
    logprobs = chunked_logprobs_from_hidden(states, weight, input_ids, temperature, chunk, mask)
    ent = chunked_entropy_from_hidden(states, weight, temperature, chunk, mask) if entropy else None
    shifted = F.pad(states[:, :-1], (0, 0, 1, 0)) if hidden else None
    return TokenScores(logprobs, ent, shifted, weight, states)


def response_logprobs(
    model: nn.Module, batch: RolloutBatch, temperature: float, chunk_size: int | None
) -> Tensor:
    """`[B, T]` log-probs of `batch`'s response tokens under `model` (0 elsewhere)."""
    return score_tokens(
        model,
        batch.input_ids,
        batch.attention_mask,
        temperature=temperature,
        mask=batch.response_mask,
        chunk_size=chunk_size,
    ).logprobs


def teacher_view(
    teacher_hidden: Tensor, teacher_logprobs: Tensor, teacher_positions: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Map a teacher forward on the hinted contexts into the student's layout.

    Args:
        teacher_hidden: `[B, T', H]` final hidden states of the teacher forward.
        teacher_logprobs: `[B, T']` teacher log-probs of its own sequence.
        teacher_positions: `[B, T]` teacher position of each student token, -1 where unmapped.

    Returns:
        `[B, T]` teacher log-probs of the student's tokens, `[B, T, H]` the teacher hidden state
        predicting each student token, and `[B, T]` bool where a valid position was mapped
        (1 <= p < T'). Unmapped or out-of-range positions give zeros, never an index error.
    """
    B, Tp, H = teacher_hidden.shape
    valid = (teacher_positions >= 1) & (teacher_positions < Tp)  # [B, T]
    safe = torch.where(valid, teacher_positions, torch.zeros_like(teacher_positions))
    lp = teacher_logprobs.gather(1, safe)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    h = teacher_hidden.gather(
        1, (safe - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, H)
    )  # [B, T, H]
    h = torch.where(valid.unsqueeze(-1), h, torch.zeros_like(h))
    return lp, h, valid


# ---------------------------------------------------------------------------- step inputs
@dataclass(frozen=True)
class Forwards:
    """What the forwards of a step need, handed in whole (a `ComposerModule` builds it).

    Attributes:
        policy: the policy (trained).
        reference: the frozen reference model, or None.
        teacher: the frozen teacher, or None: the live policy on the hinted contexts.
        temperature: the sampling temperature (log-probs of `logits / temperature`).
        chunk_size: tokens per LM-head chunk; None: ≈ 8 MiB of fp32 logits per chunk on CPU (64 MiB on an
            accelerator), at least H / 8 tokens.
        entropy: the policy forward computes entropies (an entropy bonus reads them).
        topk: k of the top-k values heads read (`teacher_topk`: top-k OPD); 0: none.
    """

    policy: nn.Module
    reference: nn.Module | None
    teacher: nn.Module | None
    temperature: float
    chunk_size: int | None
    entropy: bool = False
    topk: int = 0


def by_piece(
    mb: RolloutBatch,
    plan: Plan | None,
    which: str,
    fn: Callable[[RolloutBatch], dict[str, Tensor]],
) -> dict[str, Tensor]:
    """`fn`'s per-row values of `mb`, computed per micro-batch of `plan` (its `which` forward:
    "student" or "teacher") and put back in `mb`'s rows and columns (zeros past a micro-batch's
    width); `fn(mb)` itself without a plan. A placeholder's values are dropped."""
    if plan is None:
        return fn(mb)
    B, T = mb.input_ids.shape
    out: dict[str, Tensor] = {}
    for rows, sub in plan.pieces(mb, which):
        values = fn(sub)
        if rows is None:
            continue
        for key, v in values.items():
            if key not in out:
                shape = (B,) if v.dim() == 1 else (B, T, *v.shape[2:])
                out[key] = v.new_zeros(shape)
            if v.dim() == 1:
                out[key][rows] = v
            else:
                out[key][rows, : v.shape[1]] = v
    return out


def policy_scores(
    f: Forwards, mb: RolloutBatch, needs: set[str], final: tuple[Tensor, Tensor] | None = None
) -> TokenScores:
    """The policy forward of a step on `mb`: log-probs, and the entropies and hidden states
    when the objective reads them (of the given `final` states and LM head: no forward)."""
    return score_tokens(
        f.policy,
        mb.input_ids,
        mb.attention_mask,
        temperature=f.temperature,
        mask=mb.response_mask,
        entropy=f.entropy or "entropy" in needs,
        hidden=bool(needs & {"hidden", "logits"}),
        chunk_size=f.chunk_size,
        final=final,
    )


def step_context(
    f: Forwards,
    mb: RolloutBatch,
    targets: RolloutTargets,
    needs: set[str],
    *,
    global_step: int,
    aggregation: str,
    norm_length: int | None = None,
    scores: TokenScores | None = None,
    rollout: RolloutBatch | None = None,
    rows: Tensor | None = None,
) -> StepContext:
    """One policy forward (grad) on a minibatch plus its rows of the rollout targets; given
    `scores` (the micro-batched step's outputs, `accumulate.py`), no forward.

    Args:
        global_step, aggregation: the `StepContext`'s; norm_length: `token_sum_norm`'s
            length, None: the batch's `max_response_length`.
        rollout, rows: the whole rollout batch and the minibatch's rows of it (None: the
            minibatch is the rollout batch).
    """
    policy, reference = f.policy, f.reference
    temperature, chunk_size = f.temperature, f.chunk_size
    if norm_length is None:
        norm_length = mb.max_response_length
    want_hidden = bool(needs & {"hidden", "logits"})
    if scores is None:
        scores = policy_scores(f, mb, needs)
    provided: dict[str, object] = {}
    if scores.entropy is not None:
        provided["entropy"] = scores.entropy
    if want_hidden:
        provided["hidden"], provided["lm_head_weight"] = scores.hidden, scores.lm_head_weight
    for key in (
        "ref_logprobs",
        "teacher_logprobs",
        "teacher_aligned",
        "teacher_hidden",
        "teacher_topk",
    ):
        if getattr(targets, key) is not None:
            provided[key] = getattr(targets, key)
    if targets.teacher_hidden is not None:
        weight = targets.teacher_lm_head_weight
        provided["teacher_lm_head_weight"] = (
            weight if weight is not None else scores.lm_head_weight.detach()
        )
    old = targets.old_logprobs if targets.old_logprobs is not None else scores.logprobs.detach()
    other_states: list[Tensor] = []  # of the forwards heads make on other sequences

    def policy_forward(ids: Tensor, attn: Tensor, mask: Tensor) -> Tensor:
        out = score_tokens(
            policy, ids, attn, temperature=temperature, mask=mask, chunk_size=chunk_size
        )
        assert out.states is not None  # score_tokens returns them
        other_states.append(out.states)
        return out.logprobs

    def reference_forward(ids: Tensor, attn: Tensor, mask: Tensor) -> Tensor:
        assert reference is not None  # handed out only with a reference (below)
        return score_tokens(
            reference, ids, attn, temperature=temperature, mask=mask, chunk_size=chunk_size
        ).logprobs

    return StepContext(
        global_step=global_step,
        logprobs=scores.logprobs,
        old_logprobs=old,
        aggregation=aggregation,
        norm_length=norm_length,
        temperature=temperature,
        chunk_size=chunk_tokens(scores.lm_head_weight, chunk_size),
        behavior_logprobs=targets.behavior_logprobs,
        states=scores.states,
        rollout=rollout,
        rows=rows,
        _other_states=other_states,
        _provided=provided,
        _policy_forward=policy_forward,
        _reference_forward=reference_forward if reference is not None else None,
    )

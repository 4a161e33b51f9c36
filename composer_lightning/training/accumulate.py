"""The policy side of a micro-batched optimizer step (`microbatch.py` explains the two passes).

`outputs` (pass 1) runs a no-grad policy forward per micro-batch and returns the minibatch's
per-token outputs as leaf tensors that require grad, for `forward.step_context`; the objective
runs once on them. `backward` (pass 2) then takes the loss's gradients with respect to those
leaves and, per micro-batch, a forward with grad and `torch.autograd.backward(outputs,
gradients)`, so the parameter gradients are the unbatched step's.

A step that measures each head's gradient at the final hidden states (`functional/gradients.py`)
keeps those states as the leaves instead (`states=True`): pass 1 stores the minibatch's `[B, T,
H]` states and computes the per-token outputs from them with grad (the chunked LM head, once
for the whole minibatch), so the measurement is over the whole minibatch, as without
micro-batches; pass 2 backpropagates `d loss / d states` through the transformer alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from composer_lightning.models.sharding import is_fsdp2
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.training.forward import (
    Forwards,
    TokenScores,
    by_piece,
    policy_scores,
)
from composer_lightning.training.hidden import final_hidden
from composer_lightning.training.microbatch import Plan, gradient_sync

#: The per-token outputs pass 2 replays, as named in `TokenScores`.
_PER_TOKEN = ("logprobs", "entropy", "hidden")


def outputs(
    f: Forwards, mb: RolloutBatch, plan: Plan, needs: set[str], states: bool = False
) -> TokenScores:
    """Pass 1: the policy's outputs on `mb`, per micro-batch without grad, as leaves (with
    `states`: the final hidden states are the leaves, the outputs computed from them).

    The LM head weight is the policy's own parameter (a head that reads hidden states and the
    LM head, SDPO, puts its gradient there directly), except under FSDP2, where the gathered
    weight exists only around a forward: then a detached copy stands in (a leaf too) and its
    gradient is handed to the live weight in pass 2."""
    weight: list[Tensor] = []

    def forward(sub: RolloutBatch) -> dict[str, Tensor]:
        if states:
            hidden, head = final_hidden(f.policy, sub.input_ids, sub.attention_mask)
            weight[:] = [head]
            return {"states": hidden}
        scores = policy_scores(f, sub, needs)
        weight[:] = [scores.lm_head_weight]
        return {k: getattr(scores, k) for k in _PER_TOKEN if getattr(scores, k) is not None}

    with torch.no_grad():
        values = by_piece(mb, plan, "student", forward)
    leaves = {k: v.requires_grad_() for k, v in values.items()}
    head = weight[0]
    if ("hidden" in leaves or states) and is_fsdp2(f.policy):
        # FSDP2's gathered LM head lives only around a forward: a copy stands in for it (a
        # leaf that collects the gradient, unless the head is frozen: LoRA)
        head = head.detach().clone().requires_grad_(head.requires_grad)
    if states:
        return policy_scores(f, mb, needs, final=(leaves["states"], head))
    return TokenScores(leaves["logprobs"], leaves.get("entropy"), leaves.get("hidden"), head)


def backward(
    f: Forwards,
    loss: Tensor,
    scores: TokenScores,
    mb: RolloutBatch,
    plan: Plan,
    needs: set[str],
    run_backward: Callable[[Tensor], None],
) -> None:
    """Pass 2: the gradients of `loss` (the objective on pass 1's `scores`) into the policy's
    parameters, a micro-batch at a time; FSDP2 reduce-scatters at the last backward only.

    Args:
        run_backward: the backward of `loss` itself (Lightning's `manual_backward`): it gives
            the leaves their gradients and runs any policy forward a head made on other
            sequences (replay DPO's pairs) back into the parameters.
    """
    policy = f.policy
    if scores.states is not None:  # pass 1 kept the states: the outputs hang off them
        leaves = {"states": scores.states}
    else:
        leaves = {k: getattr(scores, k) for k in _PER_TOKEN if getattr(scores, k) is not None}
    head: Tensor | None = scores.lm_head_weight
    stand_in = scores.hidden is not None or scores.states is not None
    if not stand_in or not is_fsdp2(policy) or not scores.lm_head_weight.requires_grad:
        head = None  # no stand-in copy: any gradient is in the parameter already
    with gradient_sync(policy, False):
        run_backward(loss)
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    pieces = list(plan.pieces(mb, "student"))
    for n, (rows, sub) in enumerate(pieces):
        with gradient_sync(policy, n == len(pieces) - 1):
            if "states" in leaves:
                states, live_head = final_hidden(policy, sub.input_ids, sub.attention_mask)
                live = {"states": states}
            else:
                scored = policy_scores(f, sub, needs)
                live = {k: getattr(scored, k) for k in leaves}
                live_head = scored.lm_head_weight
            outs, ins = [], []
            for key in leaves:
                out = live[key]
                width = out.shape[1]
                outs.append(out)
                ins.append(
                    torch.zeros_like(out)
                    if rows is None
                    else grads[key][rows, :width].to(out.dtype)
                )
            if head is not None and n == 0 and head.grad is not None:
                outs.append(live_head)  # the LM head's own use: SDPO's, or all with `states`
                ins.append(head.grad.to(live_head.dtype))
            torch.autograd.backward(outs, ins)

"""The policy side of a micro-batched optimizer step (`microbatch.py` explains the two passes).

`outputs` (pass 1) runs a no-grad policy forward per micro-batch and returns the minibatch's
per-token outputs as leaf tensors that require grad, for `forward.step_context`; the objective
runs once on them. `backward` (pass 2) then takes the loss's gradients with respect to those
leaves and, per micro-batch, a forward with grad and `torch.autograd.backward(outputs,
gradients)`, so the parameter gradients are the unbatched step's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from composer_lightning.batch import RolloutBatch
from composer_lightning.forward import Forwards, TokenScores, by_piece, policy_scores
from composer_lightning.microbatch import Plan, gradient_sync

#: The per-token outputs pass 2 replays, as named in `TokenScores`.
_PER_TOKEN = ("logprobs", "entropy", "hidden")


def outputs(f: Forwards, mb: RolloutBatch, plan: Plan, needs: set[str]) -> TokenScores:
    """Pass 1: the policy's outputs on `mb`, per micro-batch without grad, as leaves.

    The LM head weight is the policy's own parameter (a head that reads hidden states and the
    LM head, SDPO, puts its gradient there directly), except under FSDP2, where the gathered
    weight exists only around a forward: then a detached copy stands in (a leaf too) and its
    gradient is handed to the live weight in pass 2."""
    weight: list[Tensor] = []

    def forward(sub: RolloutBatch) -> dict[str, Tensor]:
        scores = policy_scores(f, sub, needs)
        weight[:] = [scores.lm_head_weight]
        return {k: getattr(scores, k) for k in _PER_TOKEN if getattr(scores, k) is not None}

    with torch.no_grad():
        values = by_piece(mb, plan, "student", forward)
    leaves = {k: v.requires_grad_() for k, v in values.items()}
    head = weight[0]
    if "hidden" in leaves and _fsdp2(f.policy):
        # FSDP2's gathered LM head lives only around a forward: a copy stands in for it (a
        # leaf that collects the gradient, unless the head is frozen: LoRA)
        head = head.detach().clone().requires_grad_(head.requires_grad)
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
    leaves = {k: getattr(scores, k) for k in _PER_TOKEN if getattr(scores, k) is not None}
    head = scores.lm_head_weight
    if scores.hidden is None or not _fsdp2(policy) or not head.requires_grad:
        head = None  # no stand-in copy: any gradient is in the parameter already
    with gradient_sync(policy, False):
        run_backward(loss)
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    pieces = list(plan.pieces(mb, "student"))
    for n, (rows, sub) in enumerate(pieces):
        with gradient_sync(policy, n == len(pieces) - 1):
            live = policy_scores(f, sub, needs)
            outs, ins = [], []
            for key in leaves:
                out = getattr(live, key)
                width = out.shape[1]
                outs.append(out)
                ins.append(
                    torch.zeros_like(out)
                    if rows is None
                    else grads[key][rows, :width].to(out.dtype)
                )
            if head is not None and n == 0 and head.grad is not None:
                outs.append(live.lm_head_weight)  # the SDPO term's own use of the LM head
                ins.append(head.grad.to(live.lm_head_weight.dtype))
            torch.autograd.backward(outs, ins)


def _fsdp2(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2's `fully_shard`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)

"""Replay DPO: sigmoid DPO (Rafailov et al. 2023; cDPO label smoothing) on replayed pairs.

The head owns a FIFO replay buffer. Each rollout batch, groups whose rewards differ give one
(chosen = best, rejected = worst) pair, stored with reference log-probs = the trainer's
log-probs at record time (or, with `reference="model"`, the frozen reference model's at use
time). Each step it samples `pairs_per_step` pairs and asks the step context for their policy
log-probs. The buffer and its sampler are part of the checkpoint.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from composer_lightning.functional import dpo_loss, dpo_rewards, sequence_logprobs
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.heads.schedules import Schedule
from composer_lightning.protocols.batch import RolloutBatch, pad_rows
from composer_lightning.protocols.step import StepContext


class ReplayDPOHead(Head):
    """Sigmoid DPO on pairs replayed from past rollouts.

    Args:
        weight: the loss weight.
        beta: DPO temperature (> 0).
        label_smoothing: cDPO ε in [0, 0.5).
        capacity: buffer size (oldest pairs are evicted).
        pairs_per_step: pairs sampled per step.
        reference: `record` (trainer log-probs when recorded) or `model` (frozen reference).
        seed: seed of the sampler.
        name: metric prefix (default `replay_dpo`).
        schedule: optional weight schedule of the global step.
    """

    default_name = "replay_dpo"
    requires = frozenset({"sequence_logprobs"})

    def __init__(
        self,
        weight: float = 0.1,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        capacity: int = 1024,
        pairs_per_step: int = 4,
        reference: Literal["record", "model"] = "record",
        seed: int = 0,
        name: str | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__(name=name, weight=weight, schedule=schedule)
        if capacity < 1 or pairs_per_step < 1:
            raise ValueError(
                f"{self.name}: capacity ({capacity}) and pairs_per_step "
                f"({pairs_per_step}) must be >= 1"
            )
        if reference not in ("record", "model"):
            raise ValueError(
                f"{self.name}: reference must be 'record' or 'model', got {reference!r}"
            )
        if not beta > 0:
            raise ValueError(f"{self.name}: beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(
                f"{self.name}: label_smoothing must be in [0, 0.5), got {label_smoothing}"
            )
        if reference == "model":
            self.requires = self.requires | {"ref_logprobs"}
        self.beta, self.label_smoothing, self.reference = beta, label_smoothing, reference
        self.capacity, self.pairs_per_step = capacity, pairs_per_step
        self.buffer: list[dict[str, Tensor]] = []
        self.generator = torch.Generator().manual_seed(seed)

    def _add(self, pair: dict[str, Tensor]) -> None:
        self.buffer.append(pair)
        del self.buffer[: max(0, len(self.buffer) - self.capacity)]

    def on_rollout(self, batch: RolloutBatch, old_logprobs: Tensor) -> None:
        ref = sequence_logprobs(old_logprobs, batch.response_mask)  # [B], the record-time reference

        def row(i: int) -> tuple[Tensor, Tensor, Tensor]:
            keep = batch.attention_mask[i].bool()
            return batch.input_ids[i][keep].cpu(), batch.response_mask[i][keep].cpu(), ref[i].cpu()

        for g in torch.unique(batch.group_ids):
            idx = torch.nonzero((batch.group_ids == g) & batch.has_reward).flatten()
            if len(idx) < 2:
                continue
            r = batch.rewards[idx]
            if r.max() == r.min():
                continue
            c, rj = int(idx[r.argmax()]), int(idx[r.argmin()])
            (c_ids, c_resp, c_ref), (r_ids, r_resp, r_ref) = row(c), row(rj)
            self._add(
                {
                    "chosen": c_ids,
                    "chosen_resp": c_resp,
                    "ref_chosen": c_ref,
                    "rejected": r_ids,
                    "rejected_resp": r_resp,
                    "ref_rejected": r_ref,
                }
            )
        if batch.dpo_pairs is not None:
            p = batch.dpo_pairs
            for i in range(len(p)):
                ck, rk = p.chosen_attention_mask[i].bool(), p.rejected_attention_mask[i].bool()
                self._add(
                    {
                        "chosen": p.chosen_input_ids[i][ck].cpu(),
                        "chosen_resp": p.chosen_response_mask[i][ck].bool().cpu(),
                        "ref_chosen": p.ref_chosen_logprobs[i].cpu(),
                        "rejected": p.rejected_input_ids[i][rk].cpu(),
                        "rejected_resp": p.rejected_response_mask[i][rk].bool().cpu(),
                        "ref_rejected": p.ref_rejected_logprobs[i].cpu(),
                    }
                )

    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        if not self.buffer:
            # The policy and reference forwards are collectives under FSDP2: run them on every
            # rank in every step, on a placeholder (the batch's first sample) that contributes
            # exactly 0.
            keep = batch.attention_mask[0].bool()
            ids, resp = batch.input_ids[:1, keep], batch.response_mask[:1, keep]
            seq_lp = ctx.policy_sequence_logprobs(ids, torch.ones_like(ids), resp)
            if self.reference == "model":
                ctx.reference_sequence_logprobs(ids, torch.ones_like(ids), resp)
            return HeadOutput(loss=seq_lp.sum() * 0.0, metrics={"buffer_size": 0.0, "pairs": 0.0})
        k = min(self.pairs_per_step, len(self.buffer))
        picks = torch.randperm(len(self.buffer), generator=self.generator)[:k].tolist()
        pairs = [self.buffer[i] for i in picks]
        seqs = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        resp_rows = [p["chosen_resp"] for p in pairs] + [p["rejected_resp"] for p in pairs]
        device = ctx.logprobs.device
        ids = pad_rows(seqs).to(device)
        attn = pad_rows([torch.ones_like(s) for s in seqs]).to(device)
        resp_mask = pad_rows(resp_rows, dtype=torch.bool).to(device)
        seq_lp = ctx.policy_sequence_logprobs(ids, attn, resp_mask)  # [2k]
        if self.reference == "model":
            ref = ctx.reference_sequence_logprobs(ids, attn, resp_mask)
            ref_c, ref_r = ref[:k], ref[k:]
        else:
            ref_c = torch.stack([p["ref_chosen"] for p in pairs]).to(device, seq_lp.dtype)
            ref_r = torch.stack([p["ref_rejected"] for p in pairs]).to(device, seq_lp.dtype)
        loss = dpo_loss(
            seq_lp[:k],
            seq_lp[k:],
            ref_c,
            ref_r,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
        )
        chosen_r, rejected_r = dpo_rewards(
            seq_lp[:k].detach(), seq_lp[k:].detach(), ref_c, ref_r, beta=self.beta
        )
        return HeadOutput(
            loss=loss,
            metrics={
                "reward_accuracy": (chosen_r > rejected_r).float().mean(),
                "reward_margin": (chosen_r - rejected_r).mean(),
                "buffer_size": float(len(self.buffer)),
                "pairs": float(k),
            },
        )

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self.buffer), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = list(state["buffer"])
        self.generator.set_state(state["generator"])

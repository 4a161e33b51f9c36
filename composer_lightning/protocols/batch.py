"""The `RolloutBatch` contract between the rollout side and the module.

One rollout batch holds the surviving samples of P prompts x G samples (dropped samples never
enter it). Every per-token tensor is `[B, T]` and aligned with `input_ids` (prompt ⊕ response,
padded); `logprobs[b, t]` is the log-prob of token t given the tokens before it. See docs/design.md, "The RolloutBatch contract".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from composer_lightning.runtime.distributed import StepMetrics


@dataclass
class DPOPairs:
    """Chosen/rejected sequences for replay DPO, with stored reference log-probs.

    Per-token tensors are `[N, T]`; reference log-probs are sequence sums `[N]` over the
    response tokens.
    """

    chosen_input_ids: Tensor  # [N, Tc]
    chosen_attention_mask: Tensor  # [N, Tc]
    chosen_response_mask: Tensor  # [N, Tc]
    rejected_input_ids: Tensor  # [N, Tr]
    rejected_attention_mask: Tensor  # [N, Tr]
    rejected_response_mask: Tensor  # [N, Tr]
    ref_chosen_logprobs: Tensor  # [N]
    ref_rejected_logprobs: Tensor  # [N]

    def __len__(self) -> int:
        return int(self.chosen_input_ids.shape[0])


@dataclass
class RolloutBatch:
    """A batch of scored rollouts, as the module consumes it.

    Attributes:
        input_ids: `[B, T]` prompt ⊕ response token ids, padded.
        attention_mask: `[B, T]` 1 on real tokens.
        response_mask: `[B, T]` bool, generated tokens that carry loss.
        rewards: `[B]` float; meaningful only where `has_reward`.
        has_reward: `[B]` bool, the score provider gave a usable score.
        group_ids: `[B]` long, samples of one prompt share an id.
        max_response_length: the engine's `max_tokens`; the default `norm_length`.
        policy_version: the weight version that generated the batch; None: unknown (synthetic
            or recorded data), taken as on policy.
        engine_logprobs: `[B, T]` sampled-token log-probs reported by the engine (canary; the
            behaviour log-probs of a stale batch).
        behavior_logprobs: `[B, T]` the trainer's log-probs at `policy_version`, recomputed for
            a stale batch on some rows (NaN elsewhere) for the canary; None on policy.
        on_policy_rows: `[B]` bool, the rows the trainer's current weights sampled, in a batch
            whose other rows are older (serve's turns of several versions): the canary
            compares those rows with the trainer's log-probs. None: the batch's stamp says.
        has_teacher: `[B]` bool, an accepted hint exists for the sample.
        teacher_input_ids: `[B, T']` hinted context ⊕ the same response.
        teacher_attention_mask: `[B, T']`.
        teacher_positions: `[B, T]` long, teacher position of each student response token, -1
            elsewhere.
        sdpo_mask: `[B, T]` bool, response tokens the SDPO head supervises.
        candidate_input_ids: `[B, C, T'']` each candidate hint's teacher context ⊕ the same
            response, shortest hint first (top-k OPD's hint selection); a sample with fewer
            candidates repeats its first context in the missing ones. None: no candidates.
        candidate_attention_mask: `[B, C, T'']`.
        candidate_positions: `[B, C, T]` long, as `teacher_positions`, per candidate.
        has_candidate: `[B, C]` bool, the sample has candidate c.
        episode_ids: `[B]` long, rows that are turns of one episode share an id (its GRPO
            advantage is the episode's); None: every row is an episode of its own.
        dpo_pairs: optional replay pairs recorded by the rollout side.
        hinted: replies sampled with the hint in context (context distillation), or None: a
            batch of their own, each row the turn's student context ⊕ its hinted reply, its
            score, and the group id of the turn it answers (a minibatch reads its own groups').
        index: the prompt batch (stream position) it was made from, or None.
        metrics: the rollout side's metrics of this batch, each with its reduction over ranks;
            the module reduces and logs them with its own, once per step.
        engine_dtype: the engine's compute dtype ("float32", "bfloat16", ...; the canary's
            default threshold), or None.
        reward_components: `[B, K]` each reward function's own value of the sample (NaN where
            it gave none, or the row's reward came from elsewhere), or None; with
            `reward_weights` (K weights), what GDPO normalises one function at a time.
        sampler_shaped: the engine sampled from more than logits / temperature (top-p, top-k,
            min-p, penalties: `SamplingConfig.shaped`): `engine_logprobs` are then a behaviour
            policy's, corrected for with truncated importance weights, and not a sync check.
        extras: free-form per-batch information of the user's.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rewards: Tensor
    has_reward: Tensor
    group_ids: Tensor
    max_response_length: int
    policy_version: int | None = None
    engine_logprobs: Tensor | None = None
    behavior_logprobs: Tensor | None = None
    on_policy_rows: Tensor | None = None
    has_teacher: Tensor | None = None
    teacher_input_ids: Tensor | None = None
    teacher_attention_mask: Tensor | None = None
    teacher_positions: Tensor | None = None
    sdpo_mask: Tensor | None = None
    candidate_input_ids: Tensor | None = None
    candidate_attention_mask: Tensor | None = None
    candidate_positions: Tensor | None = None
    has_candidate: Tensor | None = None
    episode_ids: Tensor | None = None
    dpo_pairs: DPOPairs | None = None
    hinted: RolloutBatch | None = None
    index: int | None = None
    metrics: StepMetrics | None = None
    engine_dtype: str | None = None
    reward_components: Tensor | None = None
    reward_weights: tuple[float, ...] | None = None
    sampler_shaped: bool = False
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.response_mask = self.response_mask.bool()
        self.has_reward = self.has_reward.bool()
        B = self.input_ids.shape[0]
        if self.has_teacher is None:
            self.has_teacher = torch.zeros(B, dtype=torch.bool, device=self.input_ids.device)
        self.has_teacher = self.has_teacher.bool()
        if self.sdpo_mask is None:
            self.sdpo_mask = torch.zeros_like(self.response_mask)
        self.sdpo_mask = self.sdpo_mask.bool()
        self.validate()

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def validate(self) -> None:
        """Check shapes against the contract; raise `ValueError` naming the offending field."""
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(self.input_ids.shape)}")
        B, T = self.input_ids.shape
        per_token = [
            "attention_mask",
            "response_mask",
            "sdpo_mask",
            "engine_logprobs",
            "behavior_logprobs",
            "teacher_positions",
        ]
        per_sample = ["rewards", "has_reward", "group_ids", "has_teacher", "episode_ids"]
        per_sample.append("on_policy_rows")
        for name in per_token:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B, T):
                raise ValueError(
                    f"RolloutBatch.{name} has shape {tuple(t.shape)}; expected {(B, T)} like input_ids"
                )
        for name in per_sample:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B,):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(t.shape)}; expected {(B,)}")
        if self.reward_components is not None:
            K = len(self.reward_weights or ())
            if tuple(self.reward_components.shape) != (B, K):
                raise ValueError(
                    f"RolloutBatch.reward_components has shape "
                    f"{tuple(self.reward_components.shape)}; expected {(B, K)} (a column per "
                    "reward_weights entry)"
                )
        if self.teacher_input_ids is not None:
            if self.teacher_positions is None:
                raise ValueError(
                    "RolloutBatch.teacher_input_ids is set but teacher_positions is None"
                )
            if self.teacher_input_ids.shape[0] != B:
                raise ValueError(
                    f"RolloutBatch.teacher_input_ids has shape {tuple(self.teacher_input_ids.shape)}; "
                    f"expected batch size {B}"
                )
            if self.teacher_attention_mask is None or (
                self.teacher_attention_mask.shape != self.teacher_input_ids.shape
            ):
                raise ValueError(
                    "RolloutBatch.teacher_attention_mask must have the shape of teacher_input_ids "
                    f"{tuple(self.teacher_input_ids.shape)}"
                )
        if (
            self.teacher_input_ids is None
            and self.has_teacher is not None
            and bool(self.has_teacher.any())
        ):
            raise ValueError("RolloutBatch.has_teacher marks samples but teacher_input_ids is None")
        if self.candidate_input_ids is not None:
            C = self.candidate_input_ids.shape[1] if self.candidate_input_ids.dim() == 3 else -1
            expect = {
                "candidate_input_ids": (B, C, self.candidate_input_ids.shape[-1]),
                "candidate_attention_mask": (B, C, self.candidate_input_ids.shape[-1]),
                "candidate_positions": (B, C, T),
                "has_candidate": (B, C),
            }
            for name, shape in expect.items():
                t = getattr(self, name)
                if C < 0 or t is None or tuple(t.shape) != shape:
                    got = None if t is None else tuple(t.shape)
                    raise ValueError(f"RolloutBatch.{name} has shape {got}; expected {shape}")
        if self.max_response_length <= 0:
            raise ValueError(f"max_response_length must be > 0, got {self.max_response_length}")

    def select(self, index: Tensor) -> RolloutBatch:
        """The sub-batch of rows `index` (a minibatch); replay pairs, hinted replies (each
        names its group), metrics and extras are shared."""
        kwargs: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == self.batch_size:
                v = v[index]
            kwargs[f.name] = v
        return replace(self, **kwargs)

    def group_splits(self, parts: int) -> list[Tensor]:
        """Row indices of `parts` minibatches split along group boundaries (groups never split).

        Raises:
            ValueError: a group's rows are not contiguous, or there are fewer groups than parts.
        """
        if parts == 1:
            return [torch.arange(self.batch_size, device=self.input_ids.device)]
        groups = torch.unique_consecutive(self.group_ids)
        if len(torch.unique(self.group_ids)) != len(groups):
            raise ValueError(
                "minibatches > 1 needs each group's samples to be contiguous in the batch"
            )
        if len(groups) < parts:
            raise ValueError(f"minibatches={parts} but the batch has only {len(groups)} groups")
        return [
            torch.nonzero(torch.isin(self.group_ids, part)).flatten()
            for part in torch.tensor_split(groups, parts)
        ]

    def to(self, device: torch.device | str) -> RolloutBatch:
        kwargs: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v.to(device)
            elif isinstance(v, DPOPairs):
                v = DPOPairs(**{k.name: getattr(v, k.name).to(device) for k in fields(v)})
            elif isinstance(v, RolloutBatch):  # the hinted replies
                v = v.to(device)
            kwargs[f.name] = v
        return replace(self, **kwargs)


def pad_rows(
    rows: Sequence[Sequence[Any] | Tensor],
    value: float = 0,
    dtype: torch.dtype = torch.long,
    width: int | None = None,
) -> Tensor:
    """Right-pad variable-length rows into a `[len(rows), width]` tensor (width: the longest)."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out

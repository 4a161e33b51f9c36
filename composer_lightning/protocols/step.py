"""What heads read: the targets of a rollout batch and the shared outputs of one minibatch.

`RolloutTargets` are computed once per rollout batch, without grad, before its first update,
and reused by every minibatch and epoch: the old log-probs (a recompute when there is more than
one update), the reference log-probs, and ONE teacher forward on the hinted contexts (OPD's
teacher log-probs, SDPO's teacher hidden states). A teacher recomputed from the already updated
policy would drift (OpenClaw takes the teacher at sampling time).

`StepContext` adds one policy forward (grad) per minibatch. Nothing holds `[B, T, V]` logits:
heads that need full distributions (SDPO) read hidden states and the LM head and apply it in
chunks; `logits` / `teacher_logits` are built on access for plug-in heads that ask for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch import Tensor

from composer_lightning.functional import masked_aggregate, sequence_logprobs

if TYPE_CHECKING:
    from composer_lightning.protocols.batch import RolloutBatch

_MISSING = object()


class TopKTargets(NamedTuple):
    """Per response token (zeros elsewhere); `C` candidates, shortest first.

    Attributes:
        old_ids, old_logprobs: `[B, T, K]` top-k of π_old.
        teacher_ids, teacher_logprobs: `[B, C, T, K]` top-k of each candidate's teacher.
        teacher_at_old: `[B, C, T, K]` the teacher's log-probs at π_old's top-k ids.
        old_at_teacher: `[B, C, T, K]` π_old's log-probs at the teacher's top-k ids.
        aligned: `[B, C]` bool, the candidate's teacher context maps onto the response tokens.
    """

    old_ids: Tensor
    old_logprobs: Tensor
    teacher_ids: Tensor
    teacher_logprobs: Tensor
    teacher_at_old: Tensor
    old_at_teacher: Tensor
    aligned: Tensor

    def select(self, index: Tensor) -> TopKTargets:
        """The rows `index` of every tensor."""
        return TopKTargets(*(t[index] for t in self))


@dataclass(frozen=True)
class RolloutTargets:
    """No-grad values of one rollout batch, shared by all its updates (`[B, ...]` rows); built
    whole (`targets.rollout_targets`), never completed by mutation.

    Attributes:
        old_logprobs: `[B, T]` log-probs of the policy before the first update, or None (with a
            single update they are the current log-probs, detached).
        ref_logprobs: `[B, T]` reference-model log-probs, or None.
        teacher_logprobs: `[B, T]` teacher log-probs of the student's tokens (0 where unmapped).
        teacher_aligned: `[B]` bool, every required token maps to the same teacher token.
        teacher_hidden: `[B, T, H]` the teacher hidden state predicting each student token.
        teacher_lm_head_weight: `[V, H]` the teacher's LM head; None means the live policy's
            (unchanged since the teacher forward: a single update).
        behavior_logprobs: `[B, T]` log-probs of the policy that sampled the batch when it is
            an older version than the trainer's (overlapped generation); None on policy.
        teacher_topk: the top-k values of π_old and of each candidate hint's teacher (top-k
            OPD), or None.
    """

    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    teacher_aligned: Tensor | None = None
    teacher_hidden: Tensor | None = None
    teacher_lm_head_weight: Tensor | None = None
    behavior_logprobs: Tensor | None = None
    teacher_topk: TopKTargets | None = None

    def select(self, index: Tensor) -> RolloutTargets:
        """The rows `index` of every per-sample tensor (the LM head weight is shared)."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "teacher_lm_head_weight" or value is None:
                continue
            picked[f.name] = value.select(index) if f.name == "teacher_topk" else value[index]
        return replace(self, **picked)


@dataclass
class StepContext:
    """What a head may read for one minibatch.

    Attributes:
        global_step: the optimizer step count.
        logprobs: `[B, T]` policy log-probs of the sampling distribution (grad), computed on the
            response tokens (0 elsewhere); so are `old_logprobs` and `ref_logprobs`.
        old_logprobs: `[B, T]` log-probs of the policy before this rollout batch's first
            update (detached): the sampling policy, or the proximal one for a stale batch.
        behavior_logprobs: `[B, T]` log-probs of the older policy version that sampled a stale
            batch (the engine's); None on policy. The surrogate's importance weights
            `min(exp(old − behaviour), cap)` come from it.
        aggregation: the module's aggregation mode; `norm_length` its normaliser.
        temperature: the sampling temperature the log-probs are taken at.
        chunk_size: tokens per LM-head chunk, for heads that apply the LM head themselves.
        states: `[B, T, H]` the policy's final hidden states every per-token output above is
            computed from (grad), where each head's share of the gradient is measured
            (`functional/gradients.py`); None when a micro-batched step did not keep them.
        rollout: the whole rollout batch this minibatch was drawn from, and `rows` the
            minibatch's rows of it (`[B]` long); None: the minibatch is the rollout batch.
            Statistics "over the batch" (TRL's `scale_rewards="batch"`, GDPO's batch
            normalisation) are the rollout batch's, whatever the minibatches: `over_rollout`.
    """

    global_step: int
    logprobs: Tensor
    old_logprobs: Tensor
    aggregation: str
    norm_length: int | None
    temperature: float
    chunk_size: int = 1024
    behavior_logprobs: Tensor | None = None
    states: Tensor | None = None
    rollout: RolloutBatch | None = None
    rows: Tensor | None = None
    _other_states: list[Tensor] = field(default_factory=list)
    _provided: dict[str, object] = field(default_factory=dict)
    _policy_forward: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
    _reference_forward: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def has(self, key: str) -> bool:
        """Whether `key` (e.g. "entropy") was computed for this step."""
        return key in self._provided

    def _value(self, key: str) -> object:
        value = self._provided.get(key, _MISSING)
        if value is _MISSING:
            raise AttributeError(
                f"'{key}' was not computed for this step: a head that reads it "
                "must list it in its `requires`"
            )
        return value

    def _get(self, key: str) -> Tensor:
        return cast(Tensor, self._value(key))  # every key but "teacher_topk" holds a tensor

    @property
    def entropy(self) -> Tensor:
        """`[B, T]` entropy of the sampling distribution predicting token t (grad)."""
        return self._get("entropy")

    @property
    def hidden(self) -> Tensor:
        """`[B, T, H]` the policy hidden state predicting token t (grad); logits are
        `hidden @ lm_head_weight.T`."""
        return self._get("hidden")

    @property
    def lm_head_weight(self) -> Tensor:
        """`[V, H]` the policy's LM head (grad)."""
        return self._get("lm_head_weight")

    @property
    def logits(self) -> Tensor:
        """`[B, T, V]` raw policy logits, row t predicts token t (grad). Built on access: full
        logits, for plug-in heads only; prefer `hidden` with a chunked function."""
        if "logits" in self._provided:
            return self._get("logits")
        return self.hidden @ self.lm_head_weight.T

    @property
    def teacher_logprobs(self) -> Tensor:
        """`[B, T]` teacher log-probs of the student's tokens (no grad); 0 where unmapped."""
        return self._get("teacher_logprobs")

    @property
    def teacher_aligned(self) -> Tensor:
        """`[B]` bool: the sample's teacher positions map onto the same tokens."""
        return self._get("teacher_aligned")

    @property
    def teacher_hidden(self) -> Tensor:
        """`[B, T, H]` the teacher hidden state predicting each student token (no grad)."""
        return self._get("teacher_hidden")

    @property
    def teacher_lm_head_weight(self) -> Tensor:
        """`[V, H]` the teacher's LM head (no grad)."""
        return self._get("teacher_lm_head_weight")

    @property
    def teacher_logits(self) -> Tensor:
        """`[B, T, V]` raw teacher logits predicting each student token (no grad). Built on
        access: full logits, for plug-in heads only."""
        if "teacher_logits" in self._provided:
            return self._get("teacher_logits")
        return self.teacher_hidden @ self.teacher_lm_head_weight.T

    @property
    def teacher_topk(self) -> TopKTargets:
        """The top-k values of π_old and of each candidate hint's teacher (no grad)."""
        return cast(TopKTargets, self._value("teacher_topk"))

    @property
    def ref_logprobs(self) -> Tensor:
        """`[B, T]` reference-model log-probs (no grad)."""
        return self._get("ref_logprobs")

    def policy_states(self) -> list[Tensor]:
        """The final hidden states of every policy forward of this step (grad): the
        minibatch's, then those of each forward a head made on other sequences (replay DPO's
        pairs), in call order. Disjoint variables: a gradient over all of them is their
        concatenation."""
        if self.states is None:
            raise AttributeError(
                "this step kept no policy hidden states (a micro-batched step keeps them "
                "only when it measures gradients)"
            )
        return [self.states, *self._other_states]

    def over_rollout(self, batch: RolloutBatch, values: Callable[[RolloutBatch], Tensor]) -> Tensor:
        """`values(whole rollout batch)` (`[N, ...]` per row), at this minibatch's rows: a
        per-row quantity whose statistics span the rollout batch, so that 1, 2 or 4
        minibatches train on the same values. `batch` (the minibatch) stands for the rollout
        batch where the context has none."""
        if self.rollout is None:
            return values(batch)
        return values(self.rollout)[self.rows]

    def aggregate(self, values: Tensor, mask: Tensor) -> Tensor:
        """Reduce `[B, T]` values over `mask` with the module's aggregation."""
        return masked_aggregate(values, mask, self.aggregation, norm_length=self.norm_length)

    def policy_token_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor
    ) -> Tensor:
        """`[N, T]` policy log-probs of the sampling distribution on the response tokens of
        other sequences (grad; 0 elsewhere), as `logprobs` is for the batch's.

        Under FSDP2 this is a forward of the sharded policy, a collective: a head that calls it
        must call it on every rank in every step (on a placeholder when it has nothing to do).
        """
        if self._policy_forward is None:
            raise AttributeError(
                "policy forward on other sequences needs 'sequence_logprobs' in requires"
            )
        return self._policy_forward(input_ids, attention_mask, response_mask)

    def policy_sequence_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor
    ) -> Tensor:
        """`[N]` summed policy log-probs of the response tokens of other sequences (grad).

        Under FSDP2 this is a forward of the sharded policy, a collective: a head that calls it
        must call it on every rank in every step (on a placeholder when it has nothing to do).
        """
        if self._policy_forward is None:
            raise AttributeError(
                "policy forward on other sequences needs 'sequence_logprobs' in requires"
            )
        return sequence_logprobs(
            self.policy_token_logprobs(input_ids, attention_mask, response_mask), response_mask
        )

    def reference_sequence_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor
    ) -> Tensor:
        """`[N]` summed reference log-probs of the response tokens (no grad).

        Under FSDP2 this is a forward of the sharded reference, a collective: a head that calls
        it must call it on every rank in every step (on a placeholder when it has nothing to do).
        """
        if self._reference_forward is None:
            raise AttributeError(
                "reference forward needs 'ref_logprobs' in requires and a reference model"
            )
        with torch.no_grad():
            return sequence_logprobs(
                self._reference_forward(input_ids, attention_mask, response_mask), response_mask
            )

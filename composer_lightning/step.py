"""The shared outputs of one minibatch step, handed to every head.

The module fills a `StepContext` with what the active heads declared in `requires`: one policy
forward (grad), ONE teacher forward (no grad, hinted contexts) shared by every head, and a
reference forward. A head may request a policy forward on other sequences (replay pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from composer_lightning.functional import masked_aggregate, sequence_logprobs


def forward_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """`[B, T, V]` logits of a causal LM; position ids follow the attention mask (left padding)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False)
    return out if isinstance(out, Tensor) else out.logits


def shift_logits(logits: Tensor) -> Tensor:
    """`[B, T, V]` → row t holds the logits that predict token t (row 0 zeros)."""
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)


_MISSING = object()


@dataclass
class StepContext:
    """What a head may read for one minibatch.

    Attributes:
        global_step: the optimizer step count.
        logprobs: `[B, T]` policy log-probs of the sampling distribution (grad).
        old_logprobs: `[B, T]` log-probs of the policy that generated the rollout (detached).
        aggregation: the module's aggregation mode; `norm_length` its normaliser.
        temperature: the sampling temperature the log-probs are taken at.
    """

    global_step: int
    logprobs: Tensor
    old_logprobs: Tensor
    aggregation: str
    norm_length: int | None
    temperature: float
    _provided: dict[str, object] = field(default_factory=dict)
    _policy_forward: Callable[[Tensor, Tensor], Tensor] | None = None
    _reference_forward: Callable[[Tensor, Tensor], Tensor] | None = None

    def has(self, key: str) -> bool:
        """Whether `key` (e.g. "entropy") was computed for this step."""
        return key in self._provided

    def _get(self, key: str) -> object:
        value = self._provided.get(key, _MISSING)
        if value is _MISSING:
            raise AttributeError(
                f"'{key}' was not computed for this step: a head that reads it must list it in "
                f"its `requires`"
            )
        return value

    @property
    def logits(self) -> Tensor:
        """`[B, T, V]` raw policy logits; row t predicts token t (grad)."""
        return self._get("logits")  # type: ignore[return-value]

    @property
    def entropy(self) -> Tensor:
        """`[B, T]` entropy of the sampling distribution predicting token t (grad)."""
        return self._get("entropy")  # type: ignore[return-value]

    @property
    def teacher_logprobs(self) -> Tensor:
        """`[B, T]` teacher log-probs of the student's tokens (no grad); 0 where unmapped."""
        return self._get("teacher_logprobs")  # type: ignore[return-value]

    @property
    def teacher_logits(self) -> Tensor:
        """`[B, T, V]` raw teacher logits predicting each student token (no grad)."""
        return self._get("teacher_logits")  # type: ignore[return-value]

    @property
    def teacher_aligned(self) -> Tensor:
        """`[B]` bool: the sample's teacher positions map onto the same tokens."""
        return self._get("teacher_aligned")  # type: ignore[return-value]

    @property
    def ref_logprobs(self) -> Tensor:
        """`[B, T]` reference-model log-probs (no grad)."""
        return self._get("ref_logprobs")  # type: ignore[return-value]

    def aggregate(self, values: Tensor, mask: Tensor) -> Tensor:
        """Reduce `[B, T]` values over `mask` with the module's aggregation."""
        return masked_aggregate(values, mask, self.aggregation, norm_length=self.norm_length)

    def policy_sequence_logprobs(self, input_ids: Tensor, attention_mask: Tensor,
                                 response_mask: Tensor) -> Tensor:
        """`[N]` summed policy log-probs of the response tokens of other sequences (grad)."""
        if self._policy_forward is None:
            raise AttributeError("policy forward on other sequences needs 'sequence_logprobs' in requires")
        return sequence_logprobs(self._policy_forward(input_ids, attention_mask), response_mask)

    def reference_sequence_logprobs(self, input_ids: Tensor, attention_mask: Tensor,
                                    response_mask: Tensor) -> Tensor:
        """`[N]` summed reference log-probs of the response tokens (no grad)."""
        if self._reference_forward is None:
            raise AttributeError("reference forward needs 'ref_logprobs' in requires and a reference model")
        with torch.no_grad():
            return sequence_logprobs(self._reference_forward(input_ids, attention_mask), response_mask)

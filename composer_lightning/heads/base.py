"""The head protocol: what a plug-in loss head is and what it receives.

A head turns the batch and the shared step outputs into either an advantage term (`[B, T]`,
mixed into ONE clipped surrogate) or a scalar loss (added as `weight x loss`), plus metrics.
The module never branches on head type; a head declares what it needs in `requires`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from composer_lightning.heads.schedules import Schedule

if TYPE_CHECKING:
    from composer_lightning.protocols.batch import RolloutBatch
    from composer_lightning.protocols.step import StepContext

REQUIREMENTS = frozenset(
    {
        "entropy",
        "hidden",
        "logits",
        "teacher_logprobs",
        "teacher_hidden",
        "teacher_logits",
        "ref_logprobs",
        "sequence_logprobs",
        "teacher_topk",
        "hinted_replies",
    }
)
"""What a head may list in `requires`; each entry makes the step compute what the head then
reads from its `StepContext` (`ctx`) or batch:

- `entropy`: `ctx.entropy`, `[B, T]` entropy of the sampling distribution (grad).
- `hidden`: `ctx.hidden` and `ctx.lm_head_weight`, the policy's final hidden states and LM
  head (grad), for a head that applies the LM head itself, in chunks (SDPO, top-k OPD).
- `logits`: `ctx.logits`, full `[B, T, V]` policy logits built on access from the hidden
  states (for plug-in heads that cannot do without; prefer `hidden`).
- `teacher_logprobs`: `ctx.teacher_logprobs` (and `ctx.teacher_aligned`), the hinted teacher's
  log-probs of the student's tokens (no grad; OPD).
- `teacher_hidden`: `ctx.teacher_hidden` and `ctx.teacher_lm_head_weight` (no grad; SDPO).
- `teacher_logits`: `ctx.teacher_logits`, full `[B, T, V]` teacher logits built on access.
- `teacher_topk`: `ctx.teacher_topk`, the top-k of π_old and of each candidate hint's teacher
  (top-k OPD; `Head.topk` is the k).
- `ref_logprobs`: `ctx.ref_logprobs` (and `ctx.reference_sequence_logprobs`); a reference
  model is built only when a head lists it (KL, replay DPO with `reference: model`).
- `sequence_logprobs`: the head calls `ctx.policy_token_logprobs` or
  `ctx.policy_sequence_logprobs`, the policy on other sequences (replay DPO's pairs); under
  FSDP2 a collective, so it calls it on every rank in every step.
- `hinted_replies`: `batch.hinted`, replies sampled from the hinted context (context
  distillation); the rollout samples them only while such a head has a non-zero weight.

Any `teacher_*` entry (`TEACHER_SIGNALS`) makes the rollout ask for hints and the step run the
teacher forward, while the head's weight is non-zero.
"""

#: A head that reads replies sampled with the hint in context (`RolloutBatch.hinted`, context
#: distillation): the rollout samples them only while such a head has a non-zero weight.
HINTED_REPLIES = frozenset({"hinted_replies"})

#: The requirements that read a hinted teacher: without a head that has a non-zero weight and
#: one of these, no hint is asked for (a judge is not paid for nothing) and no teacher runs.
TEACHER_SIGNALS = frozenset(
    {"teacher_logprobs", "teacher_hidden", "teacher_logits", "teacher_topk"}
)

#: What the module's `teacher_cap` bounds: a head that reads a hinted teacher, or that imitates
#: the replies the hinted context wrote (context distillation), pulls at most `teacher_cap`
#: times as hard as the rest (the RL signal).
HINTED_SIGNALS = TEACHER_SIGNALS | HINTED_REPLIES


@dataclass
class HeadOutput:
    """What a head returns for one minibatch.

    Exactly one of `advantages` and `loss` is set.

    Attributes:
        advantages: `[B, T]` a term of the mixed advantage (detached), or None.
        loss: a scalar added to the objective as `weight x loss`, or None.
        active_mask: `[B, T]` bool, tokens where the advantage term is defined (used by variance
            matching); None means the response mask.
        metrics: scalars, logged as `<head name>/<metric>`.
        token_metrics: `[B, T]` per-token values of the head's own (detached), e.g. SDPO's
            divergence at each supervised token: never logged nor in the loss; read by
            whatever observes the objective (the run report's per-token details,
            `report/tokens.py`). An advantage head's per-token values are its `advantages`.
    """

    advantages: Tensor | None = None
    loss: Tensor | None = None
    active_mask: Tensor | None = None
    metrics: dict[str, Tensor | float] = field(default_factory=dict)
    token_metrics: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.advantages is None) == (self.loss is None):
            raise ValueError("HeadOutput needs exactly one of `advantages` or `loss`")
        if self.loss is not None and self.loss.dim() != 0:
            raise ValueError(
                f"HeadOutput.loss must be a scalar, got shape {tuple(self.loss.shape)}"
            )
        for key, value in self.token_metrics.items():
            if not isinstance(value, Tensor) or value.dim() != 2:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"HeadOutput.token_metrics[{key!r}] must be [B, T], got {shape}")


class Head(ABC):
    """Base class of every loss head (built-in and plug-in).

    Subclasses set `requires` (a subset of `REQUIREMENTS`) and implement `compute`. `name` is
    the metric prefix and must be unique within a module; `weight` multiplies the head's term
    and `schedule` (optional) multiplies `weight` by a function of the global step.

    Args:
        name: metric prefix; defaults to the class's `default_name`.
        weight: non-negative, finite multiplier.
        schedule: optional weight schedule of the global step.
    """

    default_name: ClassVar[str] = "head"
    requires: frozenset[str] = frozenset()  # a class default; an instance may widen its own
    #: k of the top-k values a head that requires `teacher_topk` reads (top-k OPD).
    topk: int = 0
    #: the head's advantages differ between the tokens of one response (OPD's teacher gap), so
    #: a sequence-level importance ratio (GSPO) would spread them over the response: such a head
    #: is refused with `importance_sampling_level="sequence"` (GSPO-token keeps them).
    per_token_advantages: bool = False

    def __init__(
        self, name: str | None = None, weight: float = 1.0, schedule: Schedule | None = None
    ):
        self.name = name if name is not None else self.default_name
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"head name must be a non-empty string, got {self.name!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{self.name}: weight must be a number, got {weight!r}")
        if math.isnan(weight) or math.isinf(weight) or weight < 0:
            raise ValueError(f"{self.name}: weight must be finite and >= 0, got {weight}")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ValueError(
                f"{self.name}: schedule must be a Schedule, got {type(schedule).__name__}"
            )
        unknown = set(self.requires) - REQUIREMENTS
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.requires has unknown entries {sorted(unknown)}; "
                f"expected a subset of {sorted(REQUIREMENTS)}"
            )
        self.weight = float(weight)
        self.schedule = schedule

    def effective_weight(self, step: int) -> float:
        """`weight x schedule(step)`."""
        return self.weight * (self.schedule(step) if self.schedule is not None else 1.0)

    @abstractmethod
    def compute(self, batch: RolloutBatch, ctx: StepContext) -> HeadOutput:
        """Return this head's term for one minibatch."""

    def on_rollout(self, batch: RolloutBatch, old_logprobs: Tensor) -> None:  # noqa: B027
        """Called once per rollout batch before its first update (e.g. to record replay pairs).

        Args:
            batch: the whole rollout batch.
            old_logprobs: `[B, T]` the trainer's log-probs of the batch at this point (detached).
        """

    def state_dict(self) -> dict[str, Any]:
        """Head state saved in checkpoints (replay buffers, counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore what `state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight})"

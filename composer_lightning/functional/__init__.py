"""Pure loss and advantage math: tensors in, tensors out; no Lightning, no I/O.

Heads are thin adapters over these functions; see docs/design.md, "Conventions".

May import: nothing of the package.
"""

from .advantages import (
    dr_grpo_advantages,
    episode_advantages,
    gdpo_advantages,
    grpo_advantages,
    opd_advantages,
)
from .chunked import (
    chunked_entropy_from_hidden,
    chunked_generalized_jsd,
    chunked_logprobs_from_hidden,
)
from .dpo import dpo_loss, dpo_rewards
from .importance import scored_log_ratio, truncated_importance_weights
from .jsd import generalized_jsd, generalized_jsd_per_token
from .kl import kl_penalty
from .logprobs import entropy_from_logits, logprobs_from_logits, sequence_logprobs
from .masks import high_entropy_mask, off_policy_sequence_mask
from .policy import importance_log_ratio, masked_aggregate, policy_loss

__all__ = [
    "chunked_entropy_from_hidden",
    "chunked_generalized_jsd",
    "chunked_logprobs_from_hidden",
    "dpo_loss",
    "dpo_rewards",
    "dr_grpo_advantages",
    "episode_advantages",
    "gdpo_advantages",
    "grpo_advantages",
    "high_entropy_mask",
    "importance_log_ratio",
    "entropy_from_logits",
    "generalized_jsd",
    "generalized_jsd_per_token",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_aggregate",
    "off_policy_sequence_mask",
    "opd_advantages",
    "policy_loss",
    "sequence_logprobs",
    "scored_log_ratio",
    "truncated_importance_weights",
]

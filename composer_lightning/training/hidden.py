"""A causal LM's final hidden states and LM head: what every forward of the step starts from.

The trainer never asks a model for `[B, T, V]` logits: it takes the final (normed) hidden
states and the LM-head weight, and applies the head in chunks of tokens (`functional.chunked`).
Every forward of the step (`forward.py`, `topk_targets.py`, `targets.py`, `accumulate.py`) calls down to
here, so the chunk size and the model contract are stated once.

The models are HF-style causal LMs: `get_output_embeddings()` (an LM head without bias) and
`output_hidden_states` (the last entry is the final, normed hidden state).
"""

from __future__ import annotations

from torch import Tensor, nn

from composer_lightning.models.sharding import full_weight

#: fp32 elements of one chunk's logits (16 MiB): tokens per chunk = this // V (27 at Qwen's
#: 151,936, 85 at SmolLM2's 49,152). The JSD holds ≈ 15 such tensors at once: at 64 MiB a step
#: peaked 0.7 GiB higher (bench/memory.py, 16 x 160, hidden 64), at no gain in time.
CHUNK_ELEMENTS = 2**22


def chunk_tokens(vocab_size: int, chunk_size: int | None) -> int:
    """Tokens per LM-head chunk: `chunk_size`, or ≈ 16 MiB of fp32 logits when None."""
    return chunk_size if chunk_size is not None else max(1, CHUNK_ELEMENTS // vocab_size)


def final_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """`[B, T, H]` final hidden states and the `[V, H]` LM-head weight of a causal LM.

    Position ids follow the attention mask (left padding). Only the last position's logits are
    computed by the model itself (`logits_to_keep=1`).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "bias", None) is not None:
        raise TypeError(
            f"{type(model).__name__} must be an HF-style causal LM with an LM head "
            "without bias (`get_output_embeddings()`)"
        )
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    # read after the forward: under FSDP2 the policy root's unsharded weight, a frozen root's
    # shard (gathered here)
    states = out.hidden_states[-1]
    return states, full_weight(model.get_output_embeddings().weight, states.dtype)


def vocab_size(model: nn.Module) -> int:
    """The vocabulary size of a causal LM's LM head."""
    return int(model.get_output_embeddings().weight.shape[0])

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

from composer_lightning.models.sharding import full_weight, is_fsdp2
from composer_lightning.training import padfree

#: fp32 elements of one chunk's logits on CPU (8 MiB): a chunk's JSD holds ≈ 15 such tensors
#: at once, and glibc's heap keeps what it freed. At 64 MiB a step's peak was 1.45 GiB, at 8 MiB
#: 1.02 GiB, in half the time (bench/memory.py, 16 x 160, Qwen's vocabulary, hidden 64).
CHUNK_ELEMENTS = 2**21
#: ... on an accelerator (64 MiB), where a caching allocator reuses memory and every chunk costs
#: kernel launches
CHUNK_ELEMENTS_ACCELERATOR = 2**24
#: at least hidden / this tokens per chunk: every chunk's backward reads and writes the whole
#: [V, H] weight gradient once (`addmm_`), so at hidden 896 chunks of 13 tokens made the step 20 %
#: slower than chunks of 112
TOKENS_PER_HIDDEN = 8


def chunk_tokens(lm_head_weight: Tensor, chunk_size: int | None) -> int:
    """Tokens per LM-head chunk for a `[V, H]` head: `chunk_size`, or when None ≈ 8 MiB of fp32
    logits on CPU (64 MiB on an accelerator), and at least H / 8 tokens."""
    if chunk_size is not None:
        return chunk_size
    vocab, hidden = lm_head_weight.shape
    cpu = lm_head_weight.device.type == "cpu"
    elements = CHUNK_ELEMENTS if cpu else CHUNK_ELEMENTS_ACCELERATOR
    return max(1, elements // vocab, hidden // TOKENS_PER_HIDDEN)


def final_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """`[B, T, H]` final hidden states and the `[V, H]` LM-head weight of a causal LM.

    Position ids follow the attention mask (left padding). Only the last position's logits are
    computed by the model itself (`logits_to_keep=1`). Right padding costs no decoder work: the
    rows run as forwards of like length (`padfree.py`), but for a model FSDP2 shards.
    """
    # (torch types an nn.Module's attributes as Tensor | Module: an HF method is "not callable")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    if head is None or getattr(head, "bias", None) is not None:
        raise TypeError(
            f"{type(model).__name__} must be an HF-style causal LM with an LM head "
            "without bias (`get_output_embeddings()`)"
        )

    def forward(ids: Tensor, attn: Tensor) -> Tensor:
        position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return out.hidden_states[-1]

    if padfree.enabled() and not is_fsdp2(model):
        states = padfree.grouped_states(forward, input_ids, attention_mask)
    else:
        states = forward(input_ids, attention_mask)
    # read after the forward: under FSDP2 the policy root's unsharded weight, a frozen root's
    # shard (gathered here)
    return states, full_weight(model.get_output_embeddings().weight, states.dtype)  # type: ignore[operator]


def vocab_size(model: nn.Module) -> int:
    """The vocabulary size of a causal LM's LM head."""
    return int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]

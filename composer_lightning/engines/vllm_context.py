"""The context a `VLLMEngine` holds, and vLLM's refusal of it as one line.

vLLM holds a context of `max_model_len` tokens, by default the model's own maximum, and refuses
to start unless one sequence of that length fits in its KV cache: Gemma 3 270M's 32,768 tokens
need 1.13 GiB, more than the 1 GiB `kv_cache_gib` gives on CPU, for a run whose sequences
are 20 tokens long. So an engine configured without `max_model_len` holds the context the run
needs (`engine_context`: the size the rollout callback's setup checks use,
`runtime/inputs.context_length`), and a refusal that remains is a `ConfigError` naming the
figures and the settings to change (`kv_cache_refusal`), not vLLM's traceback.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from composer_lightning.engines.base import EngineContext
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.runtime.inputs import context_length, model_context

#: vLLM 0.32's refusal (vllm/v1/core/kv_cache_utils.py, `_check_enough_kv_cache_memory`).
_REFUSAL = re.compile(
    r"max seq len \((?P<length>\d+)\), \((?P<needed>[\d.]+) GiB KV cache is needed, which is "
    r"larger than the available KV cache memory \((?P<available>[\d.]+) GiB\)"
)
_ESTIMATE = re.compile(r"estimated maximum model length is (?P<fits>\d+)")


def engine_context(engine: Any, path: str, context: EngineContext) -> tuple[int | None, str]:
    """The `max_model_len` to start vLLM with, and where it comes from: the configured one;
    else the size for `context.tokens_needed` (the figure the setup checks used); else None,
    vLLM's default, the model's own maximum."""
    if engine.llm_kwargs.get("max_model_len", engine.max_model_len):
        configured = context_length(engine, path)
        assert configured is not None  # (max_model_len is set)
        return configured[0], "max_model_len"
    if context.tokens_needed is not None:
        sized = context_length(engine, path, context.tokens_needed)
        if sized is not None:
            return sized[0], f"sized for the run's {context.tokens_needed} tokens"
    own = model_context(engine, path)
    return None, "the model's own maximum" + (f", {own[1]}" if own else "")


@contextmanager
def kv_cache_refusal(engine: Any, source: str, on_cuda: bool) -> Iterator[None]:
    """Around vLLM's start-up: its refusal because one sequence of its context does not fit in
    the KV cache becomes a one-line `ConfigError` with the figures and the settings that
    change them (`refusal_line`); other errors pass unchanged."""
    try:
        yield
    except ValueError as err:
        line = refusal_line(str(err), engine, source, on_cuda)
        if line is None:
            raise
        raise ConfigError(line) from None


def refusal_line(message: str, engine: Any, source: str, on_cuda: bool) -> str | None:
    """The one line for vLLM's KV-cache refusal `message`; None for another message.

    Args:
        engine: the `VLLMEngine` (its memory settings are named).
        source: where the context's length came from (`engine_context`).
        on_cuda: whether the engine runs on a GPU (memory is then a fraction of it).
    """
    found = _REFUSAL.search(message)
    if found is None:
        return None
    fits = _ESTIMATE.search(message)
    if on_cuda:
        memory = f"gpu_memory_utilization={engine.gpu_memory_utilization}"
        more = "raise gpu_memory_utilization"
    elif "kv_cache_memory_bytes" in engine.llm_kwargs:
        memory = f"llm_kwargs kv_cache_memory_bytes={engine.llm_kwargs['kv_cache_memory_bytes']}"
        more = "raise kv_cache_memory_bytes"
    else:
        memory = f"kv_cache_gib={engine.kv_cache_gib}"
        more = "raise kv_cache_gib"
    at_most = f" (at most {fits['fits']} tokens fit)" if fits else ""
    return (
        f"VLLMEngine: a context of {found['length']} tokens ({source}) needs "
        f"{found['needed']} GiB of KV cache for one sequence, more than the "
        f"{found['available']} GiB available ({memory}): set VLLMEngine's max_model_len to the "
        f"longest prompt + max_tokens your run needs{at_most}, or {more}"
    )

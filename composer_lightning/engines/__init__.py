"""Rollout engines: sample completions from prompt token ids, accept weight pushes.

`VLLMEngine` imports vLLM lazily, so this package imports without vLLM installed.

May import: `functional`, `runtime`, `models` (hub ids, weights under HF names).
"""

from composer_lightning.engines.base import (
    ChatEngine,
    Completion,
    Delta,
    EngineContext,
    RolloutEngine,
    SamplingConfig,
    StepEngine,
    TokenStreamEngine,
)
from composer_lightning.engines.hf import HFEngine
from composer_lightning.engines.openai import OpenAIEngine
from composer_lightning.engines.vllm import VLLMEngine
from composer_lightning.models.weights import iter_hf_weights

__all__ = [
    "ChatEngine",
    "Completion",
    "Delta",
    "EngineContext",
    "HFEngine",
    "OpenAIEngine",
    "RolloutEngine",
    "SamplingConfig",
    "StepEngine",
    "TokenStreamEngine",
    "VLLMEngine",
    "iter_hf_weights",
]

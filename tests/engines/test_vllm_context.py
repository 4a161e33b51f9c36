"""The context a VLLMEngine holds (`engines/vllm_context.py`): sized to the run when
`max_model_len` is not set, the same figure the setup checks use, and vLLM's refusal of a context
its KV cache cannot hold as one line.

Gemma 3 270M's 32,768 tokens need 1.13 GiB of KV cache, more than the 1 GiB given; the vLLM
case reproduces that with a random model whose 131,072 tokens need 2 GiB.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_lightning.engines import EngineContext, HFEngine, VLLMEngine
from composer_lightning.engines.vllm_context import engine_context, refusal_line
from composer_lightning.models.random import build_random_llama
from composer_lightning.runtime.inputs import context_length

HERE = Path(__file__).parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None

#: vLLM 0.32's message, as it refused Gemma 3 270M (vllm/v1/core/kv_cache_utils.py).
GEMMA_REFUSAL = (
    "To serve at least one request with the model's max seq len (32768), (1.13 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (1.0 GiB). Based on the "
    "available memory, the estimated maximum model length is 29000. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
    "decreasing `max_model_len` when initializing the engine."
)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """A random Llama of 131,072 positions, 16 KiB of KV cache a token (4 layers, 16 heads)."""
    return build_random_llama(
        tmp_path_factory.mktemp("long") / "long_llama",
        max_position_embeddings=131072,
        hidden_size=512,
        num_heads=16,
        num_layers=4,
        intermediate_size=256,
    )


def test_the_engine_starts_with_the_context_the_checks_sized(long_model):
    """Without max_model_len the engine and the setup checks hold one figure, twice the need
    in blocks of 256; a configured one wins; an unknown need leaves vLLM its default."""
    engine = VLLMEngine(long_model)
    checked = context_length(engine, None, 22)
    assert checked[0] == 256 and "sized for the run" in checked[1]
    assert engine_context(engine, long_model, EngineContext(tokens_needed=22))[0] == 256
    assert engine_context(engine, long_model, EngineContext(tokens_needed=300))[0] == 768
    assert engine_context(engine, long_model, EngineContext())[0] is None  # vLLM's own
    pinned = VLLMEngine(long_model, max_model_len=1000)
    assert context_length(pinned, None, 22) == (1000, "VLLMEngine max_model_len")
    assert engine_context(pinned, long_model, EngineContext(tokens_needed=22))[0] == 1000
    # an engine that does not size its context keeps the model's (HF's has no KV cache limit)
    assert context_length(HFEngine(), long_model, 22)[0] == 131072


def test_a_kv_cache_refusal_is_one_line_with_the_figures_and_the_options():
    engine = VLLMEngine.__new__(VLLMEngine)  # the settings only: nothing is loaded
    engine.kv_cache_gib, engine.gpu_memory_utilization, engine.llm_kwargs = 1, 0.3, {}
    line = refusal_line(GEMMA_REFUSAL, engine, "the model's own maximum", on_cuda=False)
    assert line is not None and "\n" not in line
    for needle in ("32768 tokens", "1.13 GiB", "1.0 GiB", "kv_cache_gib=1", "max_model_len"):
        assert needle in line, line
    assert "29000 tokens fit" in line
    on_gpu = refusal_line(GEMMA_REFUSAL, engine, "max_model_len", on_cuda=True)
    assert "gpu_memory_utilization=0.3" in on_gpu
    assert refusal_line("some other ValueError", engine, "max_model_len", False) is None


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed (pip install -e .[cpu])")
def test_vllm_refuses_the_models_context_and_takes_the_runs(long_model, tmp_path):
    out = tmp_path / "context.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "_vllm_context.py"), long_model, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    results = json.loads(out.read_text())
    refused = results["refused"]
    assert refused is not None, "vLLM started with a context its KV cache cannot hold"
    assert "\n" not in refused and "131072 tokens" in refused and "kv_cache_gib=1" in refused
    assert results["max_model_len"] == 256 and results["generated"] == [4, 4]

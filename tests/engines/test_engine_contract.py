"""The engine contract (engine_contract.py) over every engine.

HFEngine runs in this process. VLLMEngine runs all checks in ONE subprocess (an in-process vLLM
engine reseeds the global RNG, patches torch.set_num_threads and sets env vars; its import
alone takes ≈10 s), whose per-check results the vLLM cases report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_lightning.engines import HFEngine, SamplingConfig
from tests.engines import engine_contract as contract

HERE = Path(__file__).parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None
CASES = [*contract.CHECKS, "host_state"]
NEEDS_VLLM = [
    pytest.mark.vllm,
    pytest.mark.slow,  # one subprocess runs every vLLM check
    pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed (pip install -e .[cpu])"),
]
ENGINES = ["hf", pytest.param("vllm", marks=NEEDS_VLLM)]


@pytest.fixture(scope="session")
def vllm_results(tiny_llama_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm_contract") / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "_vllm_contract.py"), tiny_llama_dir, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(
            f"vLLM contract subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hf_engine(tiny_policy):
    return HFEngine(model=tiny_policy, seed=0)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engine_name", ENGINES)
def test_contract(engine_name, case, request, tiny_policy, tiny_llama_dir):
    if engine_name == "vllm":
        result = request.getfixturevalue("vllm_results")[case]
        print(json.dumps(result.get("info", {})))
        assert result["ok"], result["error"]
        return
    if case == "host_state":
        before = contract.host_snapshot()
        engine = HFEngine(model_path=tiny_llama_dir)
        engine.generate(contract.PROMPTS, 2, SamplingConfig(max_tokens=4))
        changes = contract.host_changes(before)
        assert not changes, changes
        return
    engine = request.getfixturevalue("hf_engine")
    print(json.dumps(contract.CHECKS[case](engine, tiny_policy)))


@pytest.mark.parametrize("case", [pytest.param(c, marks=NEEDS_VLLM) for c in contract.VLLM_CHECKS])
def test_vllm_scheduling(case, request):
    result = request.getfixturevalue("vllm_results")[case]
    print(json.dumps(result.get("info", {})))
    assert result["ok"], result["error"]


@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed (pip install -e .[cpu])")
def test_vllm_refuses_chunked_prefill_on_cpu(tiny_llama_dir):
    """Refused before vLLM is imported: seeded sampling with it fails on CPU (engines/vllm.py)."""
    from composer_lightning.engines import EngineContext, VLLMEngine

    engine = VLLMEngine(tiny_llama_dir, llm_kwargs={"enable_chunked_prefill": True})
    with pytest.raises(ValueError, match="enable_chunked_prefill=True fails on CPU"):
        engine.start(EngineContext(device="cpu"))
    assert engine.llm is None


def test_hf_engine_owns_its_weights(tiny_policy):
    """Pushes are real copies: changing the trainer's module leaves the engine stale."""
    engine = HFEngine(model=tiny_policy)
    assert all(
        a.data_ptr() != b.data_ptr()
        for a, b in zip(engine.model.parameters(), tiny_policy.parameters(), strict=True)
    )
    try:
        engine.load_weights([("model.nope.weight", next(tiny_policy.parameters()))], version=1)
    except KeyError as err:
        assert "model.nope.weight" in str(err)
    else:
        raise AssertionError("unknown parameter name accepted")


def test_missing_vllm_says_what_to_install(monkeypatch, tiny_llama_dir):
    from composer_lightning.engines import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e \.\[cpu\]"):
        VLLMEngine(tiny_llama_dir)

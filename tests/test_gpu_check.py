"""The GPU check script's path (vLLM engine, FSDP2 via ModelParallelStrategy, all heads, push
and canary) runs as a tiny CPU smoke test, so it is not broken when a GPU becomes available."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # the GPU check's smoke run with vLLM


def test_gpu_check_smoke_on_cpu():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--smoke",
            "--steps",
            "3",
            "--max-staleness",
            "1",  # the overlapped path: vLLM in its own process, canary through FSDP2
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{\n") :])
    assert report["engine"].startswith("vllm 0.32")
    assert report["fsdp2_sharded"] and report["loss_finite"] and report["steps_done"] == 3
    assert max(report["logprob_gap_mean_per_step"]) < 1e-5
    assert report["max_staleness"] == 1 and report["fingerprint_params"] > 0

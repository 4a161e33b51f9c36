"""The GPU check script's path (FSDP2 via ModelParallelStrategy, all heads, HF engine push and
canary) runs as a tiny CPU smoke test, so it is not broken when a GPU becomes available."""

import json
import os
import subprocess
import sys

from tests.test_cli import ROOT


def test_gpu_check_smoke_on_cpu():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert report["fsdp2_sharded"] and report["loss_finite"]
    assert report["logprob_gap_max"] < 1e-5

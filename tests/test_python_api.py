"""The Python API example (README): a `Trainer` built in Python trains, with progress in
optimizer steps (not Lightning's "Epoch 0/-2") and the run's files in its logger's directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the example trained in a process of its own

ROOT = Path(__file__).resolve().parents[1]


def test_the_python_api_example_trains_with_a_step_progress(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python_api.py"), "--engine", "hf"]
        + ["--max_steps", "3", "--root", str(tmp_path)],
        cwd=tmp_path,  # any working directory: the tiny policy is found by the package
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 3/3  reward" in out.stdout
    assert "Epoch" not in out.stdout + out.stderr
    run = tmp_path / "python_api" / "version_0"
    assert {"checkpoints", "curves.png", "rollouts.jsonl", "hparams.yaml"} <= set(os.listdir(run))
    assert (run / "checkpoints" / "last.ckpt").is_file()

"""A signal loses nothing: SIGTERM and Ctrl-C stop a CLI run at the end of a step with a
checkpoint under the run's directory and a non-zero exit, and resuming from it gives the same
weights as a run that was never stopped."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, run_cli

pytestmark = pytest.mark.slow  # runs stopped by signals, in processes of their own

CONFIG = str(ROOT / "configs" / "tiny_cpu_hf.yaml")
STEPS = 8


def _args(root) -> list[str]:
    return [
        "--config",
        CONFIG,
        f"--trainer.max_steps={STEPS}",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
    ]


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == STEPS
    return state["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    out = run_cli("fit", *_args(root))
    assert out.returncode == 0, out.stderr[-3000:]
    (last,) = glob.glob(str(root / "**" / "last.ckpt"), recursive=True)
    return _weights(last)


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_and_the_resumed_run_is_identical(
    signum, status, tmp_path, uninterrupted
):
    marker = "--trainer.callbacks+=tests.helpers.StepMarker"
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_lightning", "fit", *_args(tmp_path), marker],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # stop it once two steps are done
        if line.startswith("STEP 2"):
            proc.send_signal(signum)
            break
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == status, err[-3000:]
    (last,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    assert str(last).startswith(str(tmp_path))
    stopped_at = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 2 <= stopped_at < STEPS
    resumed = run_cli("fit", *_args(tmp_path), f"--ckpt_path={last}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = max(glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True), key=os.path.getmtime)
    weights = _weights(final)
    for name, w in uninterrupted.items():
        assert torch.equal(weights[name], w), name

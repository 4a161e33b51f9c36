"""A signal to any one of two FSDP2 ranks stops both at the end of the same step, each with
exit status 128 + the signal number, `last.ckpt` saved, nothing left running; the checkpoint
resumes to the end. A checkpoint that does not fit stops both ranks in the same save with one
error, the previous checkpoint whole (tests/scale/_stop.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, end_session
from tests.test_atomic_checkpoints import mounts  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow  # two ranks stopped by signals

SCRIPT = str(ROOT / "tests" / "scale" / "_stop.py")
STEPS, SIGNAL_IN = 5, 3  # as in _stop.py


def _run(root, *args: str) -> int:
    """Run `_stop.py` in its own session; afterwards no process of that session is left. A
    hang fails here by the timeout (the ranks' collective timeout is 30 s)."""
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *args, str(root / "out")],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        stderr = "hung: killed after 150 s"
    finally:
        end_session(proc)
    (root / "stderr.txt").write_text(stderr or "")
    return proc.returncode


def _records(root) -> list[dict]:
    return [json.loads((root / f"out.rank{r}").read_text()) for r in (0, 1)]


@pytest.mark.parametrize(
    "rank,signum", [(0, signal.SIGTERM), (1, signal.SIGTERM), (1, signal.SIGUSR1)]
)
def test_a_signal_to_one_rank_stops_both_at_the_same_step_with_a_checkpoint(rank, signum, tmp_path):
    status = 128 + int(signum)
    rc = _run(tmp_path, "signalled", str(rank), str(int(signum)))
    err = (tmp_path / "stderr.txt").read_text()
    assert rc == status, err[-3000:]
    records = _records(tmp_path)
    assert records[0]["children"] == [status]  # rank 1's own exit status
    for record in records:
        assert record["status"] == status
        assert record["global_step"] == SIGNAL_IN  # the step the signal arrived in, finished
        assert record["done"] == list(range(1, SIGNAL_IN + 1))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_dir()  # FSDP2's sharded checkpoint
    if (rank, signum) != (1, signal.SIGTERM):
        return  # one resume shows the checkpoint whole; the others are the same kind
    resumed = tmp_path / "resumed"
    rc = _run(resumed, "resumed", str(last))
    assert rc == 0, (resumed / "stderr.txt").read_text()[-3000:]
    for record in _records(resumed):
        assert record["global_step"] == STEPS
        assert record["done"] == list(range(SIGNAL_IN + 1, STEPS + 1))


@pytest.mark.parametrize("layout", ["sharded", "file"])
def test_a_checkpoint_that_does_not_fit_stops_both_ranks_with_one_error(layout, tmp_path, mounts):  # noqa: F811
    """Step 2's `last.ckpt` (FSDP2's sharded directory, or one file only rank 0 writes) finds
    room for half of itself: both ranks raise the same error in that save (no rank left
    waiting in a collective), step 1's stays whole."""
    checkpoints = tmp_path / "checkpoints"
    mounts(checkpoints, "size=64m")
    rc = _run(tmp_path, "full", layout)
    err = (tmp_path / "stderr.txt").read_text()
    assert rc == 3, err[-3000:]
    records = _records(tmp_path)
    assert records[0]["children"] == [3]
    last = checkpoints / "last.ckpt"
    assert records[0]["status"] == records[1]["status"]
    assert records[0]["status"].startswith("RankError: rank 0: CheckpointWriteError: ")
    assert f"cannot write checkpoint {last}: [Errno 28]" in records[0]["status"]
    assert [(r["global_step"], r["done"]) for r in records] == [(2, [1, 2])] * 2  # its save
    assert sorted(os.listdir(checkpoints)) == ["filler", "last.ckpt"]
    meta = last / "meta.pt" if layout == "sharded" else last
    assert torch.load(meta, weights_only=False)["global_step"] == 1

"""Two FSDP2 ranks resume exactly: a run SIGKILLed with all its ranks after a periodic
checkpoint and resumed from it ends where the uninterrupted run ends, on every rank (its own
replay buffer and RNG states, not rank 0's); and tensor parallelism of the trainer is refused
before any step (tests/scale/_resume.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import ROOT, end_session

pytestmark = pytest.mark.slow  # two ranks killed and resumed

SCRIPT = str(ROOT / "tests" / "scale" / "_resume.py")


def _run(kind: str, root, *extra: str, k: int = 0, episodes: bool = False) -> tuple[int, str]:
    """Run `_resume.py` in its own session; afterwards no process of that session is left (its
    engine processes included)."""
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MAX_STALENESS=str(k))
    env["EPISODES"] = str(int(episodes))
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, kind, str(root / "out.pt"), *extra],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:  # a hang fails here, by the timeout, and takes rank 1 with it
        end_session(proc)
    return proc.returncode, stderr


def _ranks(root) -> list[dict]:
    return [torch.load(f"{root / 'out.pt'}.rank{r}", weights_only=False) for r in (0, 1)]


def _equal_buffers(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


# k = 1 with single-turn batches ahead is the episodes case's path with a batch in place of
# episodes (the callback's ahead state): on one rank, tests/test_overlap_resume.py resumes
# batches ahead exactly after SIGTERM and kill -9 (k = 2); a third two-rank run of three
# processes each would cost the suite ~1 min for that difference.
@pytest.mark.parametrize(("k", "episodes"), [(0, False), (1, True)], ids=["k0", "k1-episodes"])
def test_kill_9_of_both_ranks_and_resume_equals_the_uninterrupted_run(k, episodes, tmp_path):
    """k = 1: each rank generates one batch ahead in its own engine process; batches 1 … 4 are
    one version stale, checked by the canary at their version (through FSDP2's forward), and
    the batch generated ahead is in each rank's checkpoint. The KL head's sharded reference
    is not in the checkpoint (rebuilt from the configuration), which holds the policy alone.
    With `episodes`, the tool task's multi-turn episodes, generated ahead whole on each rank."""
    rc, err = _run("whole", tmp_path / "whole", k=k, episodes=episodes)
    assert rc == 0, err[-3000:]
    whole = _ranks(tmp_path / "whole")
    for rank in whole:
        assert [rank["steps"][s]["staleness"] for s in (1, 2, 3, 4)] == [0] + [k] * 3
        # fp32 rounding (1.1e-5 measured with the KL head), far below the 1e-3 gate
        assert max(rank["steps"][s]["gap"] for s in (1, 2, 3, 4)) < 5e-5
        if not k:  # the teacher guard stops the teacher from step 2 (`_resume.py`)
            assert [rank["steps"][s]["teacher_off"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert not _equal_buffers(whole[0]["buffer"], whole[1]["buffer"])  # else this proves nothing
    assert whole[0]["buffer"] and whole[1]["buffer"]

    rc, err = _run("killed", tmp_path / "killed", k=k, episodes=episodes)
    assert rc == -signal.SIGKILL, err[-3000:]
    ckpt = tmp_path / "killed" / "checkpoints" / "step=2.ckpt"
    assert ckpt.is_dir() and not (tmp_path / "killed" / "checkpoints" / "step=4.ckpt").exists()
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    weights = [key for key in stored if key.startswith("state_dict.")]
    assert weights and all(key.startswith("state_dict.policy.") for key in weights)

    rc, err = _run("resumed", tmp_path / "resumed", str(ckpt), k=k, episodes=episodes)
    assert rc == 0, err[-3000:]
    resumed = _ranks(tmp_path / "resumed")
    for rank, (a, b) in enumerate(zip(whole, resumed, strict=True)):
        assert a["global_step"] == b["global_step"] == 4
        assert sorted(b["steps"]) == [3, 4]  # the killed run's step 3 is done again
        for step in (3, 4):
            want, got = a["steps"][step], b["steps"][step]
            assert got["prompts"] == want["prompts"], (rank, step)  # the stream position
            assert torch.equal(got["torch"], want["torch"]), (rank, step)
            assert got["python"] == want["python"], (rank, step)
            assert got["teacher_off"] == want["teacher_off"] or k, (rank, step)
        assert _equal_buffers(b["buffer"], a["buffer"]), rank
        for name, w in a["weights"].items():
            assert torch.equal(b["weights"][name], w), (rank, name)


def test_tensor_parallelism_of_the_trainer_is_refused_on_every_rank(tmp_path):
    rc, err = _run("tp2", tmp_path)
    assert rc != 0, err[-3000:]
    errors = [(tmp_path / f"out.pt.rank{r}.err").read_text() for r in (0, 1)]
    assert errors[0] == errors[1]
    assert errors[0].startswith("ConfigError: ModelParallelStrategy(tensor_parallel_size=2)")
    assert "data_parallel_size" in errors[0] and "vLLM" in errors[0]
    assert "\n" not in errors[0]

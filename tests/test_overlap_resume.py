"""Nothing lost with generation ahead (`max_staleness` k > 0): kill -9, SIGTERM and a resume
without pending batches all continue the run exactly or at the version it starts from, never
from weights the engine process was not given."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # an engine process per run, killed and resumed

STEPS = 8
_WHOLE: dict[tuple[int, bool], dict] = {}  # (k, episodes) → the uninterrupted run's last checkpoint


def _config(tmp_path, k: int, episodes: bool = False) -> str:
    """The HF-engine config; with `episodes`, the tool agent's (multi-turn tool episodes) on
    the HF engine."""
    config = yaml.safe_load(open(ROOT / "configs" / "tiny_cpu_hf.yaml"))
    if episodes:
        tool = yaml.safe_load(open(ROOT / "configs" / "tool_agent_cpu.yaml"))
        tool["rollout"]["init_args"]["engine"] = config["rollout"]["init_args"]["engine"]
        tool["rollout"]["init_args"]["samples_every_n_steps"] = 0
        tool["trainer"]["val_check_interval"] = STEPS
        tool["trainer"]["limit_val_batches"] = 0
        config = tool
    config["trainer"]["max_steps"] = STEPS
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["rollout"]["init_args"]["max_staleness"] = k
    if k:  # generated ahead, no engine of the trainer's checks the hints
        config["rollout"]["init_args"]["hint_trust"] = "always"
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "overlap.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _run(root, k: int, *extra, episodes: bool = False) -> subprocess.CompletedProcess:
    args = [
        "--config",
        _config(root, k, episodes),
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
    ]
    return subprocess.run(
        [sys.executable, "-m", "composer_lightning", "fit", *args, *extra],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _last(root) -> dict:
    last = max(glob.glob(str(root / "**" / "last.ckpt"), recursive=True), key=os.path.getmtime)
    return torch.load(last, map_location="cpu", weights_only=False)


def _last_path(root) -> str:
    (last,) = glob.glob(str(root / "**" / "last.ckpt"), recursive=True)
    return last


def _whole(tmp_path_factory, k: int, episodes: bool = False) -> dict:
    if (k, episodes) not in _WHOLE:
        root = tmp_path_factory.mktemp(f"whole{k}{'e' if episodes else ''}")
        run = _run(root, k, episodes=episodes)
        assert run.returncode == 0, run.stderr[-3000:]
        _WHOLE[(k, episodes)] = _last(root)
    return _WHOLE[(k, episodes)]


def _pending(checkpoint: dict) -> dict:
    (state,) = [v for k, v in checkpoint["callbacks"].items() if "RolloutCallback" in k]
    (mine,) = state["pending"]  # one rank
    return mine["batches"]


def _same_weights(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] == STEPS
    for name, w in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], w), name


def test_kill_9_and_resume_equals_the_uninterrupted_run_with_overlap(tmp_path, tmp_path_factory):
    kill = '{"class_path": "tests.helpers.KillAt", "init_args": {"step": 5}}'
    killed = _run(tmp_path, 2, f"--trainer.callbacks+={kill}")
    assert killed.returncode == -9, killed.stderr[-3000:]
    at_kill = _last(tmp_path)
    assert at_kill["global_step"] == 4
    pending = _pending(at_kill)
    # after batch 3: batches 4 and 5 were generated ahead (versions 2, 3), not trained on
    assert sorted(pending) == [4, 5] and [pending[i][0] for i in (4, 5)] == [2, 3]
    resumed = _run(tmp_path, 2, f"--ckpt_path={_last_path(tmp_path)}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_weights(_whole(tmp_path_factory, 2), _last(tmp_path))


# k = 2 holds two pending batches where k = 1 holds one (the same save and restore, a longer
# list); k = 1 itself is resumed with episodes ahead on two ranks (tests/scale/test_resume.py).
@pytest.mark.parametrize(("k", "episodes"), [(2, False), (2, True)], ids=["k2", "k2-episodes"])
def test_sigterm_saves_the_pending_batches_and_resumes_exactly(
    k, episodes, tmp_path, tmp_path_factory
):
    """SIGTERM at step 5 stops after it with `last.ckpt`: the batches generated ahead (6 …
    5 + k) are in it, so the resumed run is the uninterrupted one, bit for bit. With
    `episodes`, the tool agent's multi-turn episodes, kept whole."""
    term = '{"class_path": "tests.helpers.SignalAt", "init_args": {"step": 5}}'
    stopped = _run(tmp_path, k, f"--trainer.callbacks+={term}", episodes=episodes)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    at_stop = _last(tmp_path)
    assert at_stop["global_step"] == 6
    pending = _pending(at_stop)
    assert sorted(pending) == list(range(6, 6 + k))
    assert [pending[i][0] for i in sorted(pending)] == [i - k for i in range(6, 6 + k)]
    assert all(isinstance(pending[i][1], dict) is episodes for i in pending)
    resumed = _run(tmp_path, k, f"--ckpt_path={_last_path(tmp_path)}", episodes=episodes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_weights(_whole(tmp_path_factory, k, episodes), _last(tmp_path))


def test_a_resume_without_pending_batches_generates_at_the_version_it_starts_from(tmp_path):
    """A k = 0 checkpoint resumed with k = 1: nothing was generated ahead, so batch 4 (and 5)
    come from version 4, the restored weights — not version 3, which this engine process never
    had — and training goes on with finite weights."""
    term = '{"class_path": "tests.helpers.SignalAt", "init_args": {"step": 3}}'
    stopped = _run(tmp_path, 0, f"--trainer.callbacks+={term}")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    printer = '{"class_path": "tests.helpers.PrintStaleness"}'
    resumed = _run(
        tmp_path, 1, f"--ckpt_path={_last_path(tmp_path)}", f"--trainer.callbacks+={printer}"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    staleness = [tuple(map(int, m)) for m in re.findall(r"STALENESS (\d+) (\d+)", resumed.stderr)]
    assert staleness == [(4, 0), (5, 1), (6, 1), (7, 1)]
    last = _last(tmp_path)
    assert last["global_step"] == STEPS
    assert all(torch.isfinite(w).all() for w in last["state_dict"].values())

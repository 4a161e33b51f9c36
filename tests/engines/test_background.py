"""The background engine process: it samples only from versions published in it, reports their
fingerprints, dies with its trainer, closes at once, leaves no shared memory, and a hung one
is stopped."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.engines.background import BackgroundEngine, EngineTimeout
from composer_lightning.engines.base import EngineContext
from composer_lightning.models.loading import load_causal_lm
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.models.weights import iter_hf_weights
from tests.helpers import HangingEngine

pytestmark = pytest.mark.slow  # engine processes

POLICY = tiny_policy_path()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[1, 5, 7, 9], [2, 4, 6]]
SAMPLING = SamplingConfig(max_tokens=4, seed=3)


def _weights():
    return [(n, t.clone()) for n, t in iter_hf_weights(load_causal_lm(POLICY))]


def _shm_of(*pids: int) -> set[str]:
    """The /dev/shm files (shared memory, named semaphores) processes `pids` have mapped: the
    machine's /dev/shm is shared with every other process, so only these are attributable."""
    names = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            names |= {line.split()[-1] for line in f if "/dev/shm/" in line}
    return names


def _left(names: set[str]) -> set[str]:
    return {n for n in names if os.path.exists(n)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie has exited: only its entry is left for its parent to reap
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_a_resumed_engine_samples_only_from_versions_published_in_it():
    """After a resume at version 5 (nothing older published in this process), batches 5 … 7
    are generated at version 5 (not 3, 4: never written here); asking the child for an
    unpublished version is refused, not sampled from zeroed memory."""
    weights = _weights()
    bg = BackgroundEngine(HFEngine(model_path=POLICY, seed=0), EngineContext(), weights, 2)
    try:
        bg.publish(weights, 5)
        assert [bg.version_of(i) for i in (5, 6, 7, 8)] == [5, 5, 5, 6]
        bg.ask(6, PROMPTS, 2, SAMPLING)
        version, outs, _, fingerprint = bg.take(6)
        assert version == 5 and len(outs) == 2 and fingerprint
        bg.request("stale", PROMPTS, 2, SAMPLING, version=3)
        with pytest.raises(RuntimeError, match="version 3 was requested but is not published"):
            bg.take("stale")
    finally:
        bg.close()


def test_close_is_immediate_with_unread_batches_and_frees_the_ring():
    weights = _weights()
    bg = BackgroundEngine(HFEngine(model_path=POLICY, seed=0), EngineContext(), weights, 1)
    bg.publish(weights, 0)
    bg.request("up", PROMPTS, 2, SAMPLING, version=0)
    bg.take("up")  # the child is up and has mapped what it shares
    for i in range(4):  # never taken: the results pipe holds them, or the child is busy
        bg.request(i, PROMPTS * 8, 4, SAMPLING, version=0)
    pid = bg.pid
    shared = _shm_of(pid)
    assert shared  # the queues' semaphores
    bg.close()  # joins for at most half a second, then kills
    assert _gone(pid)
    for _ in range(200):  # the requests' feeder thread holds two of them until it has exited
        gc.collect()
        if not _left(shared):
            break
        time.sleep(0.05)
    assert not _left(shared)


def test_a_hung_engine_is_stopped_with_a_clear_error():
    weights = _weights()
    bg = BackgroundEngine(
        HangingEngine(model_path=POLICY, seed=0), EngineContext(), weights, 1, timeout=3
    )
    bg.publish(weights, 0)
    bg.ask(0, PROMPTS, 2, SAMPLING)
    with pytest.raises(EngineTimeout, match="returned no batch in 3 s"):
        bg.take(0)
    assert _gone(bg.pid)


TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from composer_lightning.engines import SamplingConfig
    from composer_lightning.engines.background import BackgroundEngine
    from composer_lightning.engines.base import EngineContext
    from composer_lightning.models.weights import iter_hf_weights
    from composer_lightning.models.loading import load_causal_lm
    from composer_lightning.models.tiny import tiny_policy_path
    from tests.helpers import HangingEngine

    path, marker = tiny_policy_path(), sys.argv[1]
    weights = list(iter_hf_weights(load_causal_lm(path)))
    bg = BackgroundEngine(
        HangingEngine(model_path=path, seed=0, marker=marker), EngineContext(), weights, 1
    )
    bg.publish(weights, 0)
    bg.ask(0, [[1, 2, 3]], 2, SamplingConfig(max_tokens=4, seed=0))
    while not os.path.exists(marker):  # the child is inside a generation that never ends
        time.sleep(0.05)
    print(bg.pid, flush=True)
    time.sleep(3600)
    """
)


def test_the_engine_process_dies_with_a_killed_trainer(tmp_path):
    """kill -9 of the trainer while its engine process is busy generating: the engine process
    goes too (it would never look up from that generation by itself)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path / "generating")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
        cwd=ROOT,
    )
    try:
        child = int(trainer.stdout.readline())
        assert not _gone(child)
        shared = _shm_of(trainer.pid, child)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=60)
        for _ in range(200):  # the kernel kills it with its parent (PR_SET_PDEATHSIG)
            if _gone(child):
                break
            time.sleep(0.05)
        assert _gone(child), f"engine process {child} outlived its trainer"
    finally:
        trainer.kill()
    for _ in range(200):  # the killed trainer's queues' semaphores: its resource tracker's
        if not _left(shared):
            break
        time.sleep(0.05)
    assert not _left(shared)


def test_fingerprints_follow_the_version_the_engine_holds():
    """The engine's fingerprint equals the trainer's of the version it loaded, and differs from
    the neighbouring version's in every parameter."""
    from composer_lightning.engines.fingerprint import FingerprintRecorder, fingerprint_mismatches

    model = load_causal_lm(POLICY)
    v0 = _weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4 * torch.randn_like(p))  # about one AdamW step at lr 1e-4
    v1 = [(n, t.clone()) for n, t in iter_hf_weights(model)]
    engine = HFEngine(model_path=POLICY, seed=0)
    recorder = FingerprintRecorder(v1, torch.float32)
    engine.load_weights(recorder, 1)
    held = engine.weight_fingerprint()
    assert fingerprint_mismatches(recorder.finish(), held) == ([], len(held))
    old = FingerprintRecorder(v0, torch.float32).finish()
    bad, compared = fingerprint_mismatches(old, held)
    assert compared == len(held) and len(bad) == compared

"""More than one machine: two `torchrun` nodes on loopback (`--nnodes 2 --node-rank 0|1
--nproc-per-node 1`, a rendezvous on 127.0.0.1) run the README's multi-node path with the
shipped 2-rank config (`configs/tiny_cpu_fsdp2.yaml`, its engine swapped for the HF one to
keep the test short): they train, stop together when either node's agent gets SIGTERM (as a
scheduler signals a node), with `last.ckpt`, and resume from it to exactly the uninterrupted
run's figures, step for step."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import ROOT, end_session

pytestmark = pytest.mark.slow  # two torchrun nodes

STEPS, SIGNAL_AT = 5, 2  # the signal arrives as step 3 starts: both nodes stop after it
TAGS = ("train/loss", "rollout/reward_mean", "rollout/response_length_mean")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(root, *args: str) -> list[int]:
    """Start both nodes' `torchrun` agents (each in its own session) with the CLI `args`; wait
    for both; afterwards nothing of either is left running. Returns each agent's exit status."""
    port, procs = _free_port(), []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for node in (0, 1):
        command = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "composer_lightning",
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny_cpu_fsdp2.yaml"),
            "--rollout.engine.class_path=composer_lightning.engines.HFEngine",
            "--trainer.devices=1",
            "--trainer.num_nodes=2",
            f"--trainer.max_steps={STEPS}",
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            *args,
        ]
        log = open(root / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log,
            )
        )
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=240))
        except subprocess.TimeoutExpired:
            codes.append(None)  # a hang: failed below
        finally:
            log.close()
    for proc, _ in procs:
        end_session(proc)
    return codes


def _scalars(version_dir) -> dict[str, dict[int, float]]:
    (events,) = glob.glob(str(version_dir / "events.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in TAGS}


def _log(root, node: int) -> str:
    return (root / f"node{node}.log").read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    codes = _nodes(root)
    assert codes == [0, 0], _log(root, 0)[-3000:] + _log(root, 1)[-3000:]
    return _scalars(root / "tiny_cpu_fsdp2" / "version_0")


@pytest.mark.parametrize("node", [0, 1])
def test_a_sigterm_to_either_nodes_agent_stops_both_and_the_checkpoint_resumes_exactly(
    node, uninterrupted, tmp_path
):
    signal_at = tmp_path / "signal.yaml"
    signal_at.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "callbacks": [
                        {
                            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                            "init_args": {"every_n_train_steps": 50, "save_last": True},
                        },
                        {
                            "class_path": "tests.helpers.SignalAt",
                            "init_args": {"step": SIGNAL_AT, "rank": node, "parent": True},
                        },
                    ]
                }
            }
        )
    )
    codes = _nodes(tmp_path, "--config", str(signal_at))
    logs = _log(tmp_path, 0) + _log(tmp_path, 1)
    # the signalled agent passed SIGTERM on to its worker; the other node's worker ended
    # with 128 + SIGTERM at the same step (its agent reports it), with the checkpoint
    assert "Received 15 death signal" in _log(tmp_path, node), logs[-4000:]
    assert "exitcode  : 143" in _log(tmp_path, 1 - node), logs[-4000:]
    assert codes[0] != 0 and codes[1] != 0
    last = tmp_path / "tiny_cpu_fsdp2" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"stopped by signal 15 after step {SIGNAL_AT + 1}; saved {last}" in logs
    assert last.is_dir()  # FSDP2's sharded checkpoint
    first = _scalars(tmp_path / "tiny_cpu_fsdp2" / "version_0")
    if node == 0:
        return  # one resume shows the checkpoint whole
    codes = _nodes(tmp_path, f"--ckpt_path={last}")
    assert codes == [0, 0], _log(tmp_path, 0)[-3000:]
    resumed = _scalars(tmp_path / "tiny_cpu_fsdp2" / "version_1")
    for tag in TAGS:
        steps = {**first[tag], **resumed[tag]}
        assert sorted(first[tag]) == list(range(SIGNAL_AT + 1)), tag
        assert steps == uninterrupted[tag], tag  # bit for bit, step for step

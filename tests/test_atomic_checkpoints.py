"""A checkpoint is whole or not written. On a disk with no room for the next checkpoint beside
the previous one, and in a run directory that turns read-only mid-run, the previous checkpoint
stays loadable and the run stops with one line naming the path and the OS error; FSDP2's
sharded checkpoint directories alike. A truncated checkpoint given to `--ckpt_path` is refused
in one line naming it, before anything starts."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.runtime.checkpoint_io import AtomicCheckpointIO
from composer_lightning.runtime.errors import CheckpointWriteError
from composer_lightning.training.module import ComposerModule
from tests.helpers import ROOT, FillDiskAt, run_cli, run_main, tiny_model

pytestmark = pytest.mark.slow  # runs that fill small filesystems, in processes of their own

CONFIG = str(ROOT / "configs" / "tiny_cpu_hf.yaml")


@pytest.fixture
def mounts():
    """`mount(path, *options)`: mount a tmpfs (`size=...`) at `path`; everything mounted under
    the test's paths is unmounted afterwards. Skips where mounting is not allowed."""
    mounted: list[str] = []

    def mount(path, *options: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        args = ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)]
        try:
            out = subprocess.run(args, capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.strip()}")
        mounted.append(str(path))

    yield mount
    for path in reversed(mounted):  # a bind mount a run put over it, then the tmpfs
        while subprocess.run(["mountpoint", "-q", path]).returncode == 0:
            subprocess.run(["umount", "-l", path], check=True)


class _DiskFull:
    """Pickling it fails as a full disk does, halfway through a checkpoint."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_save_that_fails_midway_leaves_the_previous_file_byte_for_byte(tmp_path):
    path = tmp_path / "last.ckpt"
    plugin = AtomicCheckpointIO()
    plugin.save_checkpoint({"global_step": 1, "w": torch.arange(1000.0)}, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointWriteError) as raised:
        plugin.save_checkpoint({"global_step": 2, "w": torch.zeros(1000), "x": _DiskFull()}, path)
    assert str(raised.value).startswith(f"cannot write checkpoint {path}: [Errno 28]")
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_the_file_put_in_place_is_the_one_written_never_a_copy(tmp_path):
    """`write_file` renames the fsynced temporary file over the destination: the destination is
    that very file (its inode), not a copy made afterwards (which a crash could cut halfway)."""
    from composer_lightning.runtime.atomic import write_file

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"old")
    written = {}

    def write(f):
        f.write(b"new" * 1000)
        written["inode"] = os.fstat(f.fileno()).st_ino

    write_file(path, write)
    assert path.read_bytes() == b"new" * 1000
    assert os.stat(path).st_ino == written["inode"]
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_a_failure_at_the_final_placement_leaves_the_previous_file_byte_for_byte(
    tmp_path, monkeypatch
):
    """The rename that puts the new file in place fails (EIO): the previous checkpoint stays
    as it was, no temporary file is left, and the error is the save's one line."""
    path = tmp_path / "last.ckpt"
    plugin = AtomicCheckpointIO()
    plugin.save_checkpoint({"global_step": 1, "w": torch.arange(1000.0)}, path)
    before = path.read_bytes()

    def failing_replace(src, dst, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointWriteError) as raised:
        plugin.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, path)
    assert str(raised.value).startswith(f"cannot write checkpoint {path}: [Errno 5]")
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.ckpt"]


def _sharded_fit(ckpts, steps: int, *callbacks, ckpt_path=None) -> L.Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    module = ComposerModule(tiny_model(torch.float32), [DrGRPOHead()], max_logprob_gap=None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=1, save_last=True),
            *callbacks,
        ],
    )
    environ = dict(os.environ)
    try:
        trainer.fit(module, SyntheticRolloutDataModule(vocab_size=64), ckpt_path=ckpt_path)
    finally:  # the strategy sets LOCAL_RANK etc. here, which a later CLI run would inherit
        os.environ.clear()
        os.environ.update(environ)
    return trainer


def test_a_sharded_checkpoint_that_does_not_fit_leaves_the_previous_ones(tmp_path, mounts):
    """FSDP2 (ModelParallelStrategy, one process): step 2's directories are written beside
    step 1's, to be swapped in; with room for half of one, the error names it, nothing of it
    is left, step 1's resume, and the resumed run's `last.ckpt` replaces step 1's."""
    ckpts = tmp_path / "ckpts"
    mounts(ckpts, "size=8m")
    _sharded_fit(tmp_path / "probe", 1)  # the size of one checkpoint directory
    size = sum(f.stat().st_size for f in (tmp_path / "probe" / "last.ckpt").rglob("*"))
    with pytest.raises(CheckpointWriteError) as raised:
        _sharded_fit(ckpts, 3, FillDiskAt(1, str(ckpts), keep=size // 2))
    step_2 = ckpts / "epoch=0-step=2.ckpt"
    assert str(raised.value).startswith(f"cannot write checkpoint {step_2}: [Errno 28]")
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=1.ckpt", "filler", "last.ckpt"]
    last = ckpts / "last.ckpt"
    assert last.is_dir()
    os.unlink(ckpts / "filler")
    resumed = _sharded_fit(ckpts, 2, ckpt_path=str(last))
    assert resumed.global_step == 2  # it resumed at step 1 and ran one more
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 2


def _cli_args(run, *callbacks: dict, steps: int = 3) -> list[str]:
    return [
        "--config",
        CONFIG,
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.callbacks={json.dumps(list(callbacks))}",
    ]


def _every_step(dirpath, top_k: int = 0) -> dict:
    """`last.ckpt` after every step (and the latest `epoch=0-step=N.ckpt` with `top_k=1`)."""
    return {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": str(dirpath),
            "every_n_train_steps": 1,
            "save_top_k": top_k,
            "save_last": True,
        },
    }


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_ones_and_one_line(tmp_path, mounts):
    """Step 2's checkpoint finds 1 MB free (it needs ≈ 8.5 MB): the error names it, nothing of
    it is left, step 1's files are whole."""
    ckpts = tmp_path / "ckpts"
    mounts(ckpts, "size=64m")
    fill = {
        "class_path": "tests.helpers.FillDiskAt",
        "init_args": {"step": 1, "path": str(ckpts), "keep": 1_000_000},
    }
    out = run_cli("fit", *_cli_args(tmp_path / "run", _every_step(ckpts, top_k=1), fill))
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        f"composer_lightning: cannot write checkpoint {ckpts / 'epoch=0-step=2.ckpt'}: "
        "[Errno 28] No space left on device (the previous checkpoint there, if any, is "
        "unchanged)"
    ]
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=1.ckpt", "filler", "last.ckpt"]
    for name in ("epoch=0-step=1.ckpt", "last.ckpt"):
        assert torch.load(ckpts / name, weights_only=False)["global_step"] == 1


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_run_directory_turned_read_only_mid_run_stops_with_one_line(
    checkpoints, tmp_path, mounts
):
    """Read-only after step 2. With a checkpoint after every step it is the first write to fail;
    without, TensorBoard's next write is (its writer thread fails, Lightning's logger rewraps
    the error), and then the end-of-run figure: the report is the first failure, in one line."""
    run = tmp_path / "run"
    mounts(run, "size=64m")
    ckpts = run / "ckpts"
    read_only = {
        "class_path": "tests.helpers.ReadOnlyAt",
        "init_args": {"step": 2, "path": str(run)},
    }
    saves = [_every_step(ckpts)] if checkpoints else []
    out = run_cli("fit", *_cli_args(run, *saves, read_only, steps=4))
    assert out.returncode == 1, out.stderr[-3000:]
    if checkpoints:
        first = f"cannot write checkpoint {ckpts / 'last.ckpt'}: [Errno 30] Read-only file system"
        first += " (the previous checkpoint there, if any, is unchanged)"
        assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 1
    else:
        (events,) = run.glob("tiny_cpu_hf/version_0/events.out.tfevents.*")
        first = f"cannot write {events}: [Errno 30] Read-only file system"
    assert out.stderr.splitlines() == [f"composer_lightning: {first}"]


def test_a_truncated_checkpoint_is_refused_in_one_line_before_anything_starts(tmp_path, capfd):
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(1 << 18)}, "global_step": 1}, buffer)
    truncated = tmp_path / "last.ckpt"
    truncated.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    out = run_main(capfd, "fit", *_cli_args(tmp_path / "run"), f"--ckpt_path={truncated}")
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"composer_lightning: cannot read checkpoint {truncated} (truncated")
    assert not (tmp_path / "run").exists()  # nothing was set up

"""A checkpoint is whole or not written. On a disk with no room for the next checkpoint beside
the previous one, and in a run directory that turns read-only mid-run, the previous checkpoint
stays loadable and the run stops with one line naming the path and the OS error; FSDP2's
sharded checkpoint directories alike. A truncated checkpoint given to `--ckpt_path` is refused
in one line naming it, before anything starts."""

from __future__ import annotations

import os
import subprocess

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.errors import CheckpointWriteError
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.module import ComposerModule
from tests.helpers import FillDiskAt, tiny_model


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
    trainer.fit(module, SyntheticRolloutDataModule(vocab_size=64), ckpt_path=ckpt_path)
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

"""bf16-mixed on CPU is kept where the CPU has bf16 units and becomes 32-true elsewhere, said in
one line at launch (`runtime/cpu_precision.py`)."""

from __future__ import annotations

import glob
from pathlib import Path
from unittest import mock

import pytest
import yaml

from composer_lightning.runtime import cpu_precision
from composer_lightning.runtime.cpu_precision import cpu_bf16_units, resolve_cpu_precision
from tests.helpers import ROOT, run_main


def test_bf16_mixed_is_kept_on_a_cpu_with_bf16_units():
    trainer = {"accelerator": "cpu", "precision": "bf16-mixed"}
    line = resolve_cpu_precision(trainer, units="AVX512-BF16", env={})
    assert trainer["precision"] == "bf16-mixed"
    assert line is not None and "AVX512-BF16" in line and "fp32 master weights" in line


def test_bf16_mixed_becomes_fp32_on_a_cpu_without_bf16_units():
    trainer = {"accelerator": "cpu", "precision": "bf16-mixed"}
    line = resolve_cpu_precision(trainer, units="", env={})
    assert trainer["precision"] == "32-true"
    assert line is not None and "bf16-mixed -> 32-true" in line and "COMPOSER_CPU_BF16=1" in line


def test_the_environment_keeps_an_emulated_bf16_mixed():
    trainer = {"accelerator": "cpu", "precision": "bf16-mixed"}
    line = resolve_cpu_precision(trainer, units="", env={"COMPOSER_CPU_BF16": "1"})
    assert trainer["precision"] == "bf16-mixed"
    assert line is not None and "emulated" in line


@pytest.mark.parametrize(
    "trainer",
    [
        {"accelerator": "cpu", "precision": "32-true"},  # not bf16
        {"accelerator": "cpu", "precision": "bf16-true"},  # no fp32 copy: not ours to change
        {"accelerator": "gpu", "precision": "bf16-mixed"},  # a GPU run
        {"accelerator": "cuda", "precision": "bf16-mixed"},
        None,
    ],
)
def test_other_runs_are_left_alone(trainer):
    before = dict(trainer) if trainer else None
    assert resolve_cpu_precision(trainer, units="", env={}) is None
    assert trainer == before


def test_auto_accelerator_without_a_gpu_is_a_cpu_run():
    trainer = {"accelerator": "auto", "precision": "bf16-mixed"}
    with mock.patch("torch.cuda.is_available", return_value=False):
        resolve_cpu_precision(trainer, units="", env={})
    assert trainer["precision"] == "32-true"
    trainer = {"accelerator": "auto", "precision": "bf16-mixed"}
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert resolve_cpu_precision(trainer, units="", env={}) is None
    assert trainer["precision"] == "bf16-mixed"


def test_this_cpus_bf16_units_are_those_linux_lists():
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    units = cpu_bf16_units()
    assert ("AVX512-BF16" in (units or "")) == ("avx512_bf16" in flags)
    assert ("AMX" in (units or "")) == ("amx_tile" in flags)


@pytest.mark.parametrize("units", [None, "AVX512-BF16"])
def test_the_command_line_trains_in_what_the_launch_line_says(capfd, tmp_path, units):
    """A fit asking for bf16-mixed: without bf16 units the run's own config says 32-true and the
    launch says why; with them it stays bf16-mixed."""
    with mock.patch.object(cpu_precision, "cpu_bf16_units", return_value=units):
        done = run_main(
            capfd,
            "fit",
            "--config",
            str(ROOT / "configs" / "synthetic_demo.yaml"),
            "--trainer.max_steps=1",
            "--trainer.precision=bf16-mixed",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            cwd=tmp_path,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    (saved,) = glob.glob(str(tmp_path / "**" / "config.yaml"), recursive=True)
    precision = yaml.safe_load(Path(saved).read_text())["trainer"]["precision"]
    if units:
        assert precision == "bf16-mixed"
        assert "bf16-mixed on this CPU's bf16 units (AVX512-BF16)" in done.stdout
    else:
        assert precision == "32-true"
        assert "bf16-mixed -> 32-true" in done.stdout

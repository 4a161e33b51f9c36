"""runtime/malloc.py: with the mmap threshold fixed, freed mid-size tensors leave the process."""

import subprocess
import sys

import pytest

from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.runtime import malloc
from composer_lightning.training.module import ComposerModule
from tests.helpers import tiny_model

# In a fresh process: free one 16 MiB tensor (glibc's default then raises its mmap threshold to
# 16 MiB), then make twenty 8 MiB tensors, each followed by a small one that stays alive, and
# free the big ones. Prints the resident memory they leave behind, in MiB.
SCRIPT = """
import sys, torch
from composer_lightning.runtime.malloc import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold() and not fix_mmap_threshold()  # once per process
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
big = torch.ones(4 * 2**20); del big
before = rss()
pairs = [(torch.ones(2 * 2**20), torch.ones(16 * 1024)) for _ in range(20)]
small = [s for _, s in pairs]; del pairs
print(rss() - before)
"""


def retained_mib(mode: str, **env) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1", **env},
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_fixed_threshold_gives_freed_tensors_back():
    assert retained_mib("default") > 100  # the twenty 8 MiB holes stay in the heap
    assert retained_mib("fixed") < 20  # only the small tensors (20 x 64 KiB) remain


def test_a_threshold_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setattr(malloc, "_done", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert malloc.fix_mmap_threshold() is False


def test_the_module_fixes_it_at_setup(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "composer_lightning.training.module.fix_mmap_threshold", lambda: calls.append(1)
    )
    ComposerModule(tiny_model(), [DrGRPOHead()]).setup("fit")
    assert calls == [1]

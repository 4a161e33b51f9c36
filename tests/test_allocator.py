"""The command line runs on tcmalloc where the machine has it (runtime/allocator.py): which
environment it re-executes with, that the re-executed process has the library mapped, and the
one word of the launch's summary line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_lightning.runtime import allocator
from composer_lightning.runtime.allocator import (
    PRELOADED,
    find_tcmalloc,
    malloc_in_use,
    preload_env,
)

LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_tcmalloc_goes_first_in_ld_preload_and_the_new_process_is_marked():
    env = preload_env({"PATH": "/bin", "LD_PRELOAD": "/opt/libgomp.so"}, LIB)
    assert env is not None
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/libgomp.so"  # what the user preloads stays
    assert env[PRELOADED] == LIB and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no "large alloc" lines
    assert preload_env({}, LIB) == {
        "LD_PRELOAD": LIB,
        PRELOADED: LIB,
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50),
    }


@pytest.mark.parametrize(
    "environ, found",
    [
        ({"COMPOSER_ALLOCATOR": "system"}, LIB),  # glibc's, asked for
        ({}, None),  # nothing to preload
        ({PRELOADED: LIB}, LIB),  # the re-executed process: never twice
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, LIB),  # the user's own tcmalloc
    ],
)
def test_no_re_execution_where_there_is_nothing_to_do(environ, found):
    assert preload_env(environ, found) is None


def test_an_unknown_allocator_is_one_line_naming_it():
    with pytest.raises(SystemExit, match=r"COMPOSER_ALLOCATOR='jemalloc': expected one of"):
        preload_env({"COMPOSER_ALLOCATOR": "jemalloc"}, LIB)


def test_the_minimal_build_is_found_first_and_nothing_where_there_is_none(tmp_path):
    (tmp_path / "b").mkdir()
    for name in allocator.NAMES:
        (tmp_path / "b" / name).write_bytes(b"")
    assert find_tcmalloc((str(tmp_path / "a"), str(tmp_path / "b"))) == str(
        tmp_path / "b" / "libtcmalloc_minimal.so.4"
    )
    assert find_tcmalloc((str(tmp_path / "a"),)) is None


def test_the_summary_says_why_a_run_is_on_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "loaded_tcmalloc", lambda: None)
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert (
        malloc_in_use({})
        == "malloc glibc (no tcmalloc found: apt-get install libtcmalloc-minimal4)"
    )
    assert (
        malloc_in_use({"COMPOSER_ALLOCATOR": "system"})
        == "malloc glibc (COMPOSER_ALLOCATOR=system)"
    )
    assert malloc_in_use({PRELOADED: LIB}) == f"malloc glibc (the loader refused {LIB})"
    monkeypatch.setattr(allocator, "loaded_tcmalloc", lambda: LIB)
    assert malloc_in_use({}) == "malloc tcmalloc"


CHILD = (
    "from composer_lightning.runtime.allocator import reexec_with_tcmalloc, loaded_tcmalloc\n"
    "reexec_with_tcmalloc()\n"
    "print(loaded_tcmalloc())\n"
)


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc here (setup.sh installs it)")
@pytest.mark.parametrize("choice, mapped", [(None, True), ("system", False)])
def test_the_re_executed_process_has_tcmalloc_mapped(choice, mapped):
    env = {k: v for k, v in os.environ.items() if k not in (PRELOADED, "COMPOSER_ALLOCATOR")}
    env["LD_PRELOAD"] = ""
    if choice:
        env["COMPOSER_ALLOCATOR"] = choice
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = out.stdout.strip().splitlines()[-1]
    if mapped:
        found = find_tcmalloc()
        assert found is not None and Path(seen).resolve() == Path(found).resolve(), seen
    else:
        assert seen == "None"

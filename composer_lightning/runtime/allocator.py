"""tcmalloc for the command line's runs, where the machine has it: a step's memory that stays flat
with the batch.

glibc's heap fragments under a step's mid-size buffers: at Qwen's vocabulary and 160 tokens a
sample, the peak RSS of a micro-batched 32-sample step moved between 0.99 and 1.41 GiB from one
process to the next with nothing changed (the median 1.27× that of 8 samples), where with
tcmalloc it was 0.86 GiB in every process (1.006×) and the step was faster, not slower
(docs/benchmarks/memory.md). vLLM's CPU platform preloads tcmalloc into its workers for the same
reason, and PyTorch's CPU launcher (`torch.backends.xeon.run_cpu`) does by default.

A process's malloc is chosen when it starts, so `python -m composer_lightning fit | serve | ...`
(the Lightning subcommands) re-executes itself once with the library in `LD_PRELOAD`, before it
imports anything heavy; the launch's summary line says which malloc the run has.
`COMPOSER_ALLOCATOR=system` keeps glibc's; a machine without tcmalloc (`setup.sh` installs
Debian's `libtcmalloc-minimal4` where it can, asking `find_tcmalloc` through this module's
`__main__`) runs on glibc's, as before. A library call (`ComposerModule` in your own script) is
never re-executed: preload it yourself
(`LD_PRELOAD=$(python -m composer_lightning.runtime.allocator)`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

#: The environment variable that chooses: "tcmalloc" (the default) or "system" (glibc's).
CHOICE = "COMPOSER_ALLOCATOR"
CHOICES = ("tcmalloc", "system")
#: Set in the re-executed process: the library it preloaded (and that it must not re-execute).
PRELOADED = "COMPOSER_ALLOCATOR_PRELOADED"
#: tcmalloc's file names, the minimal build first (no heap profiler: what vLLM preloads).
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
#: Where Debian, Fedora and a local build put them.
DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def find_tcmalloc(dirs: tuple[str, ...] = DIRS) -> str | None:
    """The path of tcmalloc's shared library on this machine, or None."""
    for directory in dirs:
        for name in NAMES:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    return None


def choice(environ: Mapping[str, str]) -> str:
    """`COMPOSER_ALLOCATOR`, checked: "tcmalloc" unless set."""
    value = environ.get(CHOICE, "tcmalloc")
    if value not in CHOICES:
        raise SystemExit(
            f"composer_lightning: {CHOICE}={value!r}: expected one of {list(CHOICES)} "
            "(tcmalloc: preload it where found, the default; system: glibc's malloc)"
        )
    return value


def preload_env(environ: Mapping[str, str], found: str | None) -> dict[str, str] | None:
    """The environment to re-execute with, tcmalloc (`found`) first in `LD_PRELOAD`; None when
    there is nothing to do: glibc's chosen, tcmalloc not found, already preloaded, or this is
    the re-executed process."""
    if choice(environ) == "system" or found is None or PRELOADED in environ:
        return None
    preload = environ.get("LD_PRELOAD", "")
    if "libtcmalloc" in preload:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{found}:{preload}" if preload else found
    env[PRELOADED] = found
    # tcmalloc reports each allocation over 1 GiB on stderr ("large alloc ..."); a full-vocabulary
    # step makes them by design
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 50))
    return env


def reexec_with_tcmalloc() -> None:
    """Replace this process by the same command with tcmalloc preloaded, where `preload_env`
    says to; return otherwise."""
    env = preload_env(os.environ, find_tcmalloc())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def loaded_tcmalloc() -> str | None:
    """The tcmalloc library this process has mapped (from `/proc/self/maps`), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split()  # address, perms, offset, dev, inode[, path]
        if len(fields) >= 6 and "libtcmalloc" in Path(fields[5]).name:
            return fields[5]
    return None


def malloc_in_use(environ: Mapping[str, str] = os.environ) -> str:
    """What this process allocates with, as the launch's summary line says it: read from what
    it has mapped, and why where it is glibc's."""
    loaded = loaded_tcmalloc()
    if loaded is not None:
        return "malloc tcmalloc"
    if environ.get(CHOICE) == "system":
        return f"malloc glibc ({CHOICE}=system)"
    if PRELOADED in environ:
        return f"malloc glibc (the loader refused {environ[PRELOADED]})"
    if find_tcmalloc() is None:
        return "malloc glibc (no tcmalloc found: apt-get install libtcmalloc-minimal4)"
    return "malloc glibc"  # a run started by a call of yours, not the command line


if __name__ == "__main__":  # the path to preload, for scripts of your own
    print(find_tcmalloc() or "")

"""Process plumbing and run state: what every other room stands on.

Owns: the library's errors (`errors.py`) and configuration errors as one line
(`config_errors.py`); what every rank must agree on each step (`distributed.py`); atomic file
and directory writes and the checkpoint plugin built on them (`atomic.py`, `checkpoint_io.py`);
resuming with a changed configuration (`resume.py`); checks of the rollout side's inputs at
setup (`inputs.py`); calls of user code with timeouts and value checks (`calls.py`); quiet log
output (`logs.py`); the run directory (`rundir.py`); the old import paths of moved modules
(`moved.py`); bf16 on CPU only where the CPU has bf16 units (`cpu_precision.py`); command-line
nulls jsonargparse cannot take as written (`overrides.py`).
May import: `functional` only (and the standard stack: torch, Lightning).
"""

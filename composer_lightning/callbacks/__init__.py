"""Lightning callbacks of general use, each independent of the others' order.

Owns: the progress line (`progress.py`), the stop on a signal with a checkpoint
(`stop.py`), one step axis of optimizer steps (`steps.py`), a line when a run collapses
(`collapse.py`), atomic checkpoints (`checkpoints.py`), absorbed bf16 updates (`precision.py`),
sampled rollouts written to the run directory and loggers (`samples.py`) and the curves drawn at
the end (`curves.py`). The rollout callback is the rollout side's (`rollout/callback.py`).
May import: `functional`, `runtime`.
"""

"""Data modules: prompt streams for the rollout callback, recorded tool traces, and synthetic
rollout batches.

May import: every room below it in `composer_lightning.LAYERS` (the held-out split is the rollout
side's `rollout/validation.py`; traces are packed by `rollout/packing.py`).
"""

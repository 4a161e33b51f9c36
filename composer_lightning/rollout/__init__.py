"""The rollout side: from a prompt batch to a `RolloutBatch`, and the weight push after it.

Owns: the `RolloutCallback` (`callback.py`), which starts the engine, generates, dispatches and
pushes; generation on one or several ranks and ahead of the trainer (`generation.py`,
`ahead.py`); the episode loop (`episodes.py`); score and hint providers called per
sample (`providers.py`), the four-way dispatch (`dispatch.py`), packing samples into a batch
(`packing.py`) and the rows of `rollouts.jsonl` (`sample_rows.py`); replies sampled with the
hint in context, for context distillation (`hinted.py`); held-out evaluation (`validation.py`); the setup checks (`checks.py`).
May import: every room below `datamodules` in `composer_lightning.LAYERS`, `training` included
(the canary's recompute of a stale batch).
"""

"""The training step: `ComposerModule` and everything one optimizer step runs.

Owns: the LightningModule (`module.py`) and its checkpoint hooks and additions
(`checkpoint.py`); the objective of one minibatch (`objective.py`, mixing in `mixer.py`, the
surrogate's options and token masks in `surrogate.py`, the adaptive entropy coefficient in
`entropy.py`); the forwards without `[B, T, V]` logits (`hidden.py`, `forward.py`,
`topk_targets.py`) under the one owner of a rollout batch's no-grad targets (`targets.py`),
each calling only down; the micro-batch plan (`microbatch.py`) and the accumulated backward
(`accumulate.py`); the canary (`canary.py`); a reference that follows the policy
(`refsync.py`); one write of a step's metrics (`steplog.py`); transformers' lr schedules
(`lr_schedule.py`, what TRL's `lr_scheduler_type` converts to).
May import: `functional`, `runtime`, `models`, `engines` (fingerprints), `protocols`, `heads`,
`callbacks`. Never the rollout side: it hands the module a `RolloutBatch` and nothing else.
"""

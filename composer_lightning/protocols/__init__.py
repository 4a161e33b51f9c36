"""The typed hand-offs between rooms.

Owns: `PromptBatch` (`prompts.py`), one step's prompts as the data module yields them;
`RolloutBatch` (`batch.py`), what the rollout side gives the trainer each step (the
contract in docs/design.md, "The RolloutBatch contract"), and what a head reads (`step.py`): the no-grad `RolloutTargets` of a
rollout batch, `TopKTargets`, and the `StepContext` of one minibatch.
May import: `functional`, `runtime`.
"""

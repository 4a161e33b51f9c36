"""Datamodules: prompt streams for the rollout callback, and synthetic rollout batches."""

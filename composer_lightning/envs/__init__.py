"""Environments of multi-turn episodes (`base.py`: the protocol)."""

from composer_lightning.envs.base import Environment, Message, Observation, SingleTurn

__all__ = ["Environment", "Message", "Observation", "SingleTurn"]

"""Environments of multi-turn episodes (`base.py`: the protocol; `python_tools.py`: plain
Python functions as tools).

May import: `functional`, `runtime`, `chat`.
"""

from composer_lightning.envs.base import Environment, Message, Observation, SingleTurn
from composer_lightning.envs.python_tools import PythonToolEnv, signature_text

__all__ = ["Environment", "Message", "Observation", "PythonToolEnv", "SingleTurn", "signature_text"]

"""Loss heads: the protocol, weight schedules, the registry, and the built-in heads.

Built-in head classes are imported lazily (through the registry or their modules), so that
listing heads never imports a broken plugin.

May import: `functional`, `runtime`, `protocols` (what a head reads).
"""

from composer_lightning.heads.base import REQUIREMENTS, Head, HeadOutput
from composer_lightning.heads.schedules import Constant, LinearRamp, LinearWarmup, Schedule

__all__ = [
    "REQUIREMENTS",
    "Head",
    "HeadOutput",
    "Schedule",
    "Constant",
    "LinearWarmup",
    "LinearRamp",
]

"""The head registry: the entry-point group `composer_lightning.heads`, loaded lazily.

Built-in heads register through the same group as third-party plugins. Discovery reads entry
point metadata only; a head class is imported when it is asked for. A plugin that fails to
import is reported by its entry-point name and does not hide the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points

GROUP = "composer_lightning.heads"

# Used when the distribution is not installed (e.g. running from a source tree).
_BUILTINS = {
    "dr_grpo": "composer_lightning.heads.dr_grpo:DrGRPOHead",
    "opd": "composer_lightning.heads.opd:OPDHead",
    "sdpo": "composer_lightning.heads.sdpo:SDPOHead",
    "topk_opd": "composer_lightning.heads.topk_opd:TopKOPDHead",
    "replay_dpo": "composer_lightning.heads.replay_dpo:ReplayDPOHead",
    "kl": "composer_lightning.heads.kl:KLHead",
    "sft": "composer_lightning.heads.sft:SFTHead",
    "context_distill": "composer_lightning.heads.context_distill:ContextDistillHead",
}


@dataclass
class HeadEntry:
    """One registered head: its name, `module:Class` value, and the import result."""

    name: str
    value: str
    cls: type | None = None
    error: str | None = None

    @property
    def class_path(self) -> str:
        return self.value.replace(":", ".")


def registered() -> dict[str, str]:
    """name → `module:Class` for every registered head, without importing any."""
    found = dict(_BUILTINS)
    for ep in entry_points(group=GROUP):
        found[ep.name] = ep.value
    return found


def load(name: str) -> type:
    """Import and return the head class registered as `name`."""
    reg = registered()
    if name not in reg:
        raise KeyError(f"no head registered as {name!r}; registered: {sorted(reg)}")
    module, _, attr = reg[name].partition(":")
    cls: type = getattr(import_module(module), attr)
    return cls


def load_all() -> list[HeadEntry]:
    """Import every registered head; failures are captured per entry, never raised."""
    out = []
    for name, value in sorted(registered().items()):
        entry = HeadEntry(name, value)
        try:
            entry.cls = load(name)
        except Exception as exc:  # a broken plugin must not hide the others
            entry.error = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    return out

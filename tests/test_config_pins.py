"""A shipped config states the composition options its figures depend on.

The library's composition defaults changed after several recipes were measured (the hint check,
the teacher only on the replies below their group's mean, the teacher cap: issue 49). A recipe
that left them to the defaults changed silently with them: the sparse boxed recipe's SDPO, whose
point is the groups where every reply is wrong, lost its teacher exactly there. So every
config in `configs/` (an ablation overlay read on top of its base) whose heads read a hinted
teacher states each of these options, the default's value or another: a default that changes
later cannot change a shipped recipe. Read as YAML, not through the CLI: the fast tier.
"""

from __future__ import annotations

import glob
import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer_lightning.heads.base import HINTED_SIGNALS, TEACHER_SIGNALS
from tests.helpers import ROOT

#: What a config whose heads read a hinted teacher states: `model.<key>` (and, with a cap,
#: `model.teacher_alone`), and for the rollout callback (not `serve`'s, which has neither)
#: `rollout.init_args.<key>`.
MODEL_PINS = ("teacher_cap",)
ROLLOUT_PINS = ("hint_trust", "teacher_replies", "teacher_guard", "hint_template")
#: ... of which a config whose hint heads only imitate hinted replies (context distillation,
#: capped and guarded like a teacher, but with no teacher for the check or `teacher_replies`)
#: states these
DISTILL_PINS = ("teacher_guard", "hint_template")
ROLLOUT_CALLBACK = "composer_lightning.rollout.callback.RolloutCallback"


def merged(base: Any, overlay: Any) -> Any:
    """`overlay` read after `base` as the CLI reads two `--config`s: mappings merge key by key,
    anything else (a list of heads) replaces."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for key, value in overlay.items():
            out[key] = merged(base[key], value) if key in base else value
        return out
    return overlay


def shipped() -> dict[str, dict]:
    """Every config as a run reads it, by name: an overlay on top of the base its first line
    names (`# base: configs/<name>.yaml`, tests/test_config_files.py checks that line)."""
    out = {}
    for path in sorted(glob.glob(str(ROOT / "configs" / "*.yaml"))):
        out[Path(path).name] = yaml.safe_load(Path(path).read_text())
    for path in sorted(glob.glob(str(ROOT / "configs" / "ablation" / "*.yaml"))):
        text = Path(path).read_text()
        base = yaml.safe_load((ROOT / text.splitlines()[0].removeprefix("# base: ")).read_text())
        out[f"ablation/{Path(path).name}"] = merged(base, yaml.safe_load(text))
    return out


def teacher_heads(config: dict, signals: frozenset[str] = HINTED_SIGNALS) -> list[str]:
    """The names of the config's heads whose class requires one of `signals` (default: a
    hinted teacher or the hinted context's replies)."""
    names = []
    for head in (config.get("model") or {}).get("heads") or []:
        module, _, name = head["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if set(getattr(cls, "requires", ())) & signals:
            names.append(name)
    return names


def unstated(config: dict) -> list[str]:
    """The composition options a config whose heads read a hinted teacher leaves to the
    library's defaults."""
    if not teacher_heads(config):
        return []
    model = config.get("model") or {}
    missing = [f"model.{key}" for key in MODEL_PINS if key not in model]
    if model.get("teacher_cap", 0.2) is not None and "teacher_alone" not in model:
        missing.append("model.teacher_alone")  # what the cap does where RL has no gradient
    rollout = config.get("rollout") or {}
    if rollout.get("class_path") == ROLLOUT_CALLBACK:
        args = rollout.get("init_args") or {}
        pins = ROLLOUT_PINS if teacher_heads(config, TEACHER_SIGNALS) else DISTILL_PINS
        missing += [f"rollout.init_args.{key}" for key in pins if key not in args]
    return missing


CONFIGS = shipped()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_config_with_a_teacher_head_states_the_composition_options(name):
    missing = unstated(CONFIGS[name])
    assert not missing, (
        f"configs/{name} composes {teacher_heads(CONFIGS[name])} and leaves {missing} to the "
        "library's defaults: state each (the default's value, or the one its figures were "
        "measured with), so that a later change of a default cannot change the recipe"
    )


def test_the_check_sees_each_kind_of_omission():
    """A teacher head without the pins fails, with each missing key named; with them, or with
    no teacher head (Dr. GRPO alone) it passes; context distillation states the cap, the guard
    and the template; `serve`'s callback needs only the model's."""
    opd = {"class_path": "composer_lightning.heads.opd.OPDHead"}
    grpo = {"class_path": "composer_lightning.heads.dr_grpo.DrGRPOHead"}
    distill = {"class_path": "composer_lightning.heads.context_distill.ContextDistillHead"}
    rollout = {"class_path": ROLLOUT_CALLBACK, "init_args": {"group_size": 4}}
    bare = {"model": {"heads": [grpo, opd]}, "rollout": rollout}
    assert unstated(bare) == [
        "model.teacher_cap",
        "model.teacher_alone",
        "rollout.init_args.hint_trust",
        "rollout.init_args.teacher_replies",
        "rollout.init_args.teacher_guard",
        "rollout.init_args.hint_template",
    ]
    pinned = merged(
        bare,
        {
            "model": {"teacher_cap": None},
            "rollout": {
                "init_args": {
                    "hint_trust": "always",
                    "teacher_replies": "all",
                    "teacher_guard": False,
                    "hint_template": "{hint}",
                }
            },
        },
    )
    assert unstated(pinned) == []
    assert unstated({"model": {"heads": [grpo]}, "rollout": rollout}) == []
    assert unstated({"model": {"heads": [grpo, distill]}, "rollout": rollout}) == [
        "model.teacher_cap",
        "model.teacher_alone",
        "rollout.init_args.teacher_guard",
        "rollout.init_args.hint_template",
    ]
    serve = {"class_path": "composer_lightning.serve.ServeCallback", "init_args": {}}
    assert unstated({"model": {"heads": [opd]}, "rollout": serve}) == [
        "model.teacher_cap",
        "model.teacher_alone",
    ]
    capped = merged(pinned, {"model": {"teacher_cap": 0.2}})
    assert unstated(capped) == ["model.teacher_alone"]  # with a cap, what it does alone
    assert unstated(merged(capped, {"model": {"teacher_alone": 0.0}})) == []
    # an overlay's heads replace its base's; its rollout keys merge into the base's
    assert merged({"a": {"b": 1, "c": [1, 2]}}, {"a": {"c": [3]}}) == {"a": {"b": 1, "c": [3]}}

"""docs/from_trl.md names every field TRL's `GRPOConfig` declares, once, and every option path
it gives exists here: a TRL release that adds a field, or a renamed option, fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from tests.test_cli import ROOT

PAGE = ROOT / "docs" / "from_trl.md"
ROW = re.compile(r"^\| `(?P<field>\w+)` \| (?P<here>[^|]+) \|", re.MULTILINE)


def _rows() -> dict[str, str]:
    rows = [(m["field"], m["here"].strip()) for m in ROW.finditer(PAGE.read_text())]
    fields = [f for f, _ in rows]
    assert len(fields) == len(set(fields)), "a field is named twice"
    return dict(rows)


def test_the_page_names_every_field_of_trls_grpo_config():
    trl = pytest.importorskip("trl", reason="trl not installed (pip install -e .[bench])")
    declared = list(trl.GRPOConfig.__annotations__)  # its own, not TrainingArguments'
    rows = _rows()
    assert [f for f in declared if f not in rows] == []
    assert [f for f in rows if f not in declared] == []


def _options(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def test_every_option_path_on_the_page_exists():
    """`model.x`, `rollout.x`, `rollout.sampling.x`, `rollout.engine.x`, `data.x` and
    `<head>.x` name arguments of the classes they stand for."""
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import SamplingConfig, VLLMEngine
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.kl import KLHead
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.training.module import ComposerModule

    owners = {
        "model": ComposerModule,
        "rollout": RolloutCallback,
        "rollout.sampling": SamplingConfig,
        "rollout.engine": VLLMEngine,
        "data": RolloutDataModule,
        "dr_grpo": DrGRPOHead,
        "kl": KLHead,
    }
    paths = re.findall(r"`((?:model|rollout|data|dr_grpo|kl)(?:\.\w+)+)`", PAGE.read_text())
    assert len(paths) > 30
    for path in paths:
        owner, _, option = path.rpartition(".")
        if owner == "model.optimizer.init_args":  # the optimizer's own arguments
            continue
        if owner not in owners:
            owner, option = path.split(".")[0], path.split(".")[1]
        assert option in _options(owners[owner]), path
    assert len(_rows()) == 79  # TRL 1.16's count, checked without trl installed

"""The shipped configs as files: every config (and every ablation overlay on top of the base its
first line names) parses, its saved form parses back to the same, and an overlay changes its
base only where it says. Training one step of each is tests/test_configs_fit.py's."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # every config printed in a process of its own


def base_of(overlay: str) -> str:
    """The config an overlay in configs/ablation/ is read after: its first line says
    `# base: configs/<name>.yaml`."""
    first = Path(overlay).read_text().splitlines()[0]
    assert first.startswith("# base: configs/"), f"{overlay}: first line {first!r}"
    base = ROOT / first.removeprefix("# base: ")
    assert base.is_file(), f"{overlay}: its base {base} is not a file"
    return str(base)


OVERLAYS = sorted(glob.glob(str(ROOT / "configs" / "ablation" / "*.yaml")))
# an overlay parses on top of its base, as its header's command runs it
CONFIGS = sorted(glob.glob(str(ROOT / "configs" / "*.yaml"))) + [
    f"{base_of(overlay)},{overlay}" for overlay in OVERLAYS
]


@pytest.fixture(scope="module")
def printed_configs(tmp_path_factory) -> dict:
    """`--print_config` of every shipped config and of its printed form, in one subprocess."""
    out = tmp_path_factory.mktemp("print_config") / "printed.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_print_configs.py"), str(out), *CONFIGS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: Path(p).name)
def test_every_config_parses_and_its_saved_form_parses_to_the_same(config, printed_configs):
    """`--print_config` writes what a run saves as its `config.yaml` (the parser's dump); that
    file, given back, parses to the same configuration."""
    printed = printed_configs[config]
    assert printed["status"] == 0, printed["err"]
    assert "class_path: composer_lightning" in printed["out"]
    assert printed["again_status"] == 0, printed["again_err"]
    assert printed["again_out"] == printed["out"]


def _contains(written, parsed, where: str = "") -> None:
    """Everything `written` (an overlay's YAML) says is in `parsed` (the parser's dump): a
    list replaces the base's whole list, so it must come back with the same length."""
    if isinstance(written, dict):
        assert isinstance(parsed, dict), f"{where}: {parsed!r} is not a mapping"
        for key, value in written.items():
            assert key in parsed, f"{where}.{key} is missing"
            _contains(value, parsed[key], f"{where}.{key}")
    elif isinstance(written, list):
        assert isinstance(parsed, list) and len(parsed) == len(written), f"{where}: {parsed!r}"
        for i, (a, b) in enumerate(zip(written, parsed, strict=True)):
            _contains(a, b, f"{where}[{i}]")
    else:
        assert written == parsed, f"{where}: {parsed!r}, the overlay says {written!r}"


def _differences(a, b, where: str = "") -> set[str]:
    """The paths at which two parsed configs differ (a list, or a subclass's class_path, is
    one value: the overlay replaces it whole)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.get("class_path") == b.get("class_path"):
        return {
            path
            for key in a.keys() | b.keys()
            for path in _differences(a.get(key), b.get(key), f"{where}.{key}")
        }
    return set() if a == b else {where}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: Path(p).name)
def test_an_overlay_changes_its_base_only_where_it_says(overlay, printed_configs):
    """`fit --config <base> --config <overlay>` is the base with the overlay's keys replaced:
    what the overlay writes is in the parsed config, its lists (the heads) replace the base's
    instead of adding to them, and nothing it does not name differs from the base alone."""
    base = base_of(overlay)
    merged = yaml.safe_load(printed_configs[f"{base},{overlay}"]["out"])
    alone = yaml.safe_load(printed_configs[base]["out"])
    written = yaml.safe_load(Path(overlay).read_text())
    _contains(written, merged)

    def named(path: str) -> bool:  # a key path the overlay writes, or one below it
        node = written
        for key in path.strip(".").split("."):
            if not isinstance(node, dict):
                return True
            if key not in node:
                return False
            node = node[key]
        return True

    unnamed = {path for path in _differences(alone, merged) if not named(path)}
    assert not unnamed, f"{overlay} changes {sorted(unnamed)} of {base}, which it does not name"

"""The package's layout by role: imports point down `composer_lightning.LAYERS`, no circles,
each room says what it owns and may import, long files say why, and old paths still import.

Read from the source (ast), so an import inside a function or under `TYPE_CHECKING` counts as
much as one at the top: a dependency is a dependency wherever it is written.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import composer_lightning
from composer_lightning.runtime.moved import MOVED_MODULES, MOVED_NAMES
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "composer_lightning"
#: Modules allowed at the package root: the entry points and the public names.
ROOT_MODULES = {
    "composer_lightning",
    "composer_lightning.__main__",
    "composer_lightning.cli",
    "composer_lightning.from_trl",
    "composer_lightning.lightning_cli",
}
#: A file longer than this says why in its docstring ("Why this file is long: ...").
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom, alias: str) -> str:
    if node.level:  # relative: from the module's package, up level - 1
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    return f"{base}.{alias}" if f"{base}.{alias}" in MODULES else base


def imports_of(module: str) -> set[str]:
    """The package's modules that `module` imports, anywhere in its file."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_target(module, node, a.name) for a in node.names]
        else:
            continue
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]  # an attribute of a module
            if name in MODULES and name != module and name.startswith("composer_lightning"):
                found.add(name)
    return found


def room(module: str) -> str:
    """The room of a module: its first package under the root, or "" at the root."""
    return "" if module in ROOT_MODULES else module.split(".")[1]


def layer_violations(edges: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Each import from a room to a room that is not below it (the root imports anything)."""
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            ra, rb = room(a), room(b)
            if ra == rb or ra == "":
                continue
            if rb == "" or rank[rb] > rank[ra]:
                bad.append(f"{a} ({ra or 'root'}) imports {b} ({rb or 'root'}), a room above it")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


EDGES = {m: imports_of(m) for m in MODULES}


def test_every_module_sits_in_a_room_of_the_layer_order_or_is_an_entry_point():
    rooms = {room(m) for m in MODULES} - {""}
    assert rooms == set(composer_lightning.LAYERS), (
        f"rooms not in LAYERS: {sorted(rooms - set(composer_lightning.LAYERS))}; "
        f"LAYERS without a room: {sorted(set(composer_lightning.LAYERS) - rooms)}"
    )
    assert {m for m in MODULES if room(m) == ""} == ROOT_MODULES


def test_imports_point_down_the_layers():
    assert layer_violations(EDGES, composer_lightning.LAYERS) == []


def test_functional_imports_nothing_of_the_package():
    outside = {(a, b) for a, targets in EDGES.items() if room(a) == "functional" for b in targets}
    assert {(a, b) for a, b in outside if room(b) != "functional"} == set()


def test_no_import_circles():
    assert cycles(EDGES) == []


def test_the_checks_see_an_upward_import_and_a_circle():
    """The checks themselves, on a made-up graph: what they must catch, they catch."""
    edges = {
        "composer_lightning.training.forward": {"composer_lightning.rollout.dispatch"},
        "composer_lightning.rollout.dispatch": {"composer_lightning.training.forward"},
        "composer_lightning.functional.jsd": {"composer_lightning.runtime.errors"},
        "composer_lightning.cli": {"composer_lightning.serve.app"},  # the root: allowed
    }
    bad = layer_violations(edges, composer_lightning.LAYERS)
    assert bad == [
        "composer_lightning.functional.jsd (functional) imports composer_lightning.runtime."
        "errors (runtime), a room above it",
        "composer_lightning.training.forward (training) imports composer_lightning.rollout."
        "dispatch (rollout), a room above it",
    ]
    assert cycles(edges) == [
        ["composer_lightning.rollout.dispatch", "composer_lightning.training.forward"]
    ]


def test_function_level_imports_count():
    """An import inside a function is read like one at the top (so a lazy import cannot hide
    an upward dependency)."""
    assert "composer_lightning.training.module" in EDGES["composer_lightning"]  # in __getattr__


@pytest.mark.parametrize("name", sorted(composer_lightning.LAYERS))
def test_each_room_says_what_it_owns_and_may_import(name):
    doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
    assert doc and "May import:" in doc, f"{name}/__init__.py: say what it may import"


def test_long_files_say_why():
    long = {}
    for path in MODULES.values():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if lines > MAX_LINES and "Why this file is long:" not in doc:
            long[str(path.relative_to(ROOT))] = lines
    assert long == {}, f"split by owner, or say 'Why this file is long:' in the docstring: {long}"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_imports_the_new_module_with_one_line_naming_it(old):
    new = MOVED_MODULES[old]
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    lines = [str(w.message) for w in caught if w.category is FutureWarning]
    assert len(lines) == 1 and f"{old} is now {new}" in lines[0]


@pytest.mark.parametrize("where,name", sorted(MOVED_NAMES))
def test_a_name_that_left_its_module_still_imports_from_it_with_one_line(where, name):
    new = MOVED_NAMES[(where, name)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(where), name)
    assert value is getattr(importlib.import_module(new), name)
    lines = [str(w.message) for w in caught if w.category is FutureWarning]
    assert len(lines) == 1 and f"{new}.{name}" in lines[0]
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = importlib.import_module(where).NoSuchName


@pytest.mark.slow  # the command line in a process of its own
def test_a_config_with_the_old_class_paths_still_runs_and_says_the_new_ones(tmp_path):
    text = (ROOT / "configs" / "tiny_cpu.yaml").read_text()
    old = text.replace(
        "composer_lightning.rollout.callback.RolloutCallback",
        "composer_lightning.callbacks.rollout.RolloutCallback",
    ).replace("composer_lightning.tasks.VerifierHint", "composer_lightning.tasks.base.VerifierHint")
    assert old != text
    config = tmp_path / "old.yaml"
    config.write_text(old)
    out = run_cli("fit", "--config", str(config), "--print_config")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "composer_lightning.callbacks.rollout is now composer_lightning.rollout.callback" in (
        out.stderr
    )
    assert "tasks.base.VerifierHint is now composer_lightning.tasks.verifiers.VerifierHint" in (
        out.stderr
    )


def test_the_shipped_configs_docs_and_examples_use_the_new_paths():
    old_paths = [re.escape(p) + r"(?![\w])" for p in MOVED_MODULES] + [
        re.escape(f"{m}.{n}") for m, n in MOVED_NAMES
    ]
    pattern = re.compile("|".join(old_paths))
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder, glob in (
        ("configs", "*.yaml"),
        ("docs", "*.md"),
        ("examples", "**/*"),
        ("bench", "*.py"),
        ("tests", "**/*.py"),
    ):
        files += [p for p in (ROOT / folder).glob(glob) if p.is_file()]
    stale = {}
    for path in files:
        if path.name in ("test_layout.py",) or path.suffix not in (
            ".py",
            ".md",
            ".yaml",
            ".toml",
            ".txt",
        ):
            continue
        hits = pattern.findall(path.read_text(encoding="utf-8"))
        if hits:
            stale[str(path.relative_to(ROOT))] = sorted(set(hits))
    assert stale == {}

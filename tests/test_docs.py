"""The documentation runs and agrees with the code.

Every tutorial (`docs/tutorials/*.md`) is run block by block, in order, in a fresh directory of
its own that holds links to `configs/`, `examples/` and `composer_lightning/` (so the paths the
page writes work as they do from the repository root):

- a `python` block is executed, all of a page's blocks in one namespace, the page's directory on
  `sys.path` (a module the page writes imports);
- a `bash` block's `python -m composer_lightning ...` commands are run: `heads` and `from-trl`
  as written (a `> file` redirect writes the file), `fit`, `validate` and `serve` with
  `--print_config` (the configuration with the page's overrides parses; training the shipped
  configs is `tests/test_configs_fit.py`'s), all in this process but `heads`. Any other
  command in an unmarked block fails the test, so nothing escapes by accident;
- a `yaml` block is parsed;
- an HTML comment on the line before a block marks it: `<!-- docs-test: file NAME -->` writes
  the block to NAME instead, and `<!-- docs-test: skip: REASON -->` leaves it illustrative (a
  download, a server, a GPU), the reason naming the test that runs it where there is one.

Blocks of other languages (`text`: output shown to the reader; `toml`) are not run. The rest of
the file checks what the site's sources say against the code: the README, the design page the
source cites, the benchmark pages it cites, and the documented arguments.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, run_cli, run_main

DOCS = ROOT / "docs"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))
FENCE = re.compile(
    r"(?:^<!-- docs-test: (?P<marker>[^\n]*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
COMMAND = re.compile(r"^(?:\.venv/bin/)?python -m composer_lightning (?P<args>.*)$")
#: what a page's directory links to, so that its relative paths work
LINKED = ("configs", "examples", "composer_lightning")


def blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, marker, body) of every fenced block of `page`."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start("body")) + 1, m["lang"], m["marker"] or "", m["body"])
        for m in FENCE.finditer(text)
    ]


def commands(body: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    lines = (line.split(" #")[0].strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def run_command(line: str, capfd) -> None:
    """One `python -m composer_lightning ...` line, in this process and directory."""
    match = COMMAND.match(line)
    assert match, f"not a composer_lightning command, and its block is not marked: {line}"
    args, out_file = shlex.split(match["args"]), None
    if ">" in args:
        out_file = args[args.index(">") + 1]
        args = args[: args.index(">")]
    if args[0] in ("fit", "validate", "serve"):
        args.append("--print_config")
    else:
        assert args[0] in ("heads", "from-trl"), f"no cheap way to check {line}"
    if args[0] == "heads":  # it prints to the stdout of its import: a process of its own
        done = run_cli(*args, cwd=Path.cwd())
    else:
        done = run_main(capfd, *args, cwd=Path.cwd())
    assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    if out_file:
        Path(out_file).write_text(done.stdout)


@pytest.mark.slow  # each tutorial trains tiny models end to end
@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.name)
def test_a_tutorial_runs(page, tmp_path, capfd, monkeypatch):
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = set(sys.modules)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    try:
        for line, lang, marker, body in blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            if marker.startswith("skip:"):
                assert marker.removeprefix("skip:").strip(), f"{where}: a skip needs its reason"
            elif marker.startswith("file "):
                (tmp_path / marker.removeprefix("file ").strip()).write_text(body)
            elif marker:
                raise AssertionError(f"{where}: unknown marker {marker!r}")
            elif lang == "python":
                exec(compile(body, where, "exec"), namespace)
            elif lang == "bash":
                for command in commands(body):
                    run_command(command, capfd)
            elif lang == "yaml":
                yaml.safe_load(body)
    finally:  # a module the page wrote is not the next page's
        for name in set(sys.modules) - modules:
            module = sys.modules[name]
            if str(tmp_path) in str(getattr(module, "__file__", "") or ""):
                del sys.modules[name]


def test_every_tutorial_block_is_run_or_says_why_not():
    """A block the harness would silently pass over (an unknown language, an empty skip
    reason) is a mistake in the page."""
    for page in TUTORIALS:
        for line, lang, marker, _ in blocks(page):
            where = f"{page.name}:{line}"
            assert lang in ("python", "bash", "yaml", "text", "toml"), f"{where}: ```{lang}"
            if lang == "toml":
                assert marker.startswith(("skip:", "file ")), f"{where}: a toml block is not run"


def test_every_heads_summary_is_a_whole_sentence():
    """`python -m composer_lightning heads` shows a head's first docstring line: for every
    built-in head it is a sentence that ends there, not one cut mid-way."""
    from composer_lightning.heads import registry

    for name, value in registry.registered().items():
        if value.startswith("composer_lightning."):
            first = (registry.load(name).__doc__ or "").strip().splitlines()[0]
            assert first.endswith("."), f"{name}: {first!r}"


#: Constructor arguments left undocumented in files other work owns right now.
UNDOCUMENTED = {"composer_lightning.serve.training.ServeCallback": {"judge_backoff_s"}}


def test_every_documented_argument_exists_and_every_class_option_is_documented():
    """The API reference renders each docstring's `Args:`: a name there that the signature
    lacks would document an option that does not exist, and a class (what a config's
    `class_path` builds) that documents its arguments documents all of them. A line may
    document several arguments at once (`weight, name, schedule: as Head's`)."""
    griffe = pytest.importorskip("griffe", reason="griffe comes with the docs extra")
    package = griffe.load(
        "composer_lightning",
        search_paths=[str(ROOT)],
        docstring_parser="google",
        docstring_options={"warn_unknown_params": False, "warn_missing_types": False},
    )
    unknown, undocumented = [], []

    def visit(obj) -> None:
        for member in obj.members.values():
            if member.is_alias or member.name.startswith("_"):
                continue
            if member.is_module or member.is_class:
                visit(member)
            function = member.members.get("__init__") if member.is_class else member
            if not member.is_class and not member.is_function:
                continue
            if function is None or function.is_alias or member.docstring is None:
                continue
            signature = {p.name for p in function.parameters} - {"self", "cls"}
            documented = {
                name.strip().lstrip("*")
                for section in member.docstring.parsed
                if section.kind.value == "parameters"
                for parameter in section.value
                for name in parameter.name.split(",")
            }
            unknown.extend((member.path, n) for n in sorted(documented - signature))
            missing = signature - documented - {"args", "kwargs"}
            missing -= UNDOCUMENTED.get(member.path, set())
            if documented and missing and member.is_class:
                undocumented.append((member.path, sorted(missing)))

    visit(package)
    assert unknown == [], "documented arguments that are not parameters"
    assert undocumented == [], "class arguments without a line in Args:"


def _source_files():
    for top in ("composer_lightning", "tests", "bench", "examples", "configs", "docs"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".yaml", ".md", ".txt") and path != Path(__file__):
                yield path


def test_what_the_source_cites_of_the_design_page_and_the_benchmarks_exists():
    """Code cites `docs/design.md, "<section>"` and `docs/benchmarks/<page>.md`: each section
    is a heading of the design page, each page a file."""
    design = (DOCS / "design.md").read_text()
    headings = set(re.findall(r"^#+ (.+?)\s*$", design, re.MULTILINE))
    for path in _source_files():
        text = path.read_text(errors="replace")
        assert "DESIGN.md" not in text, f"{path}: cites DESIGN.md, now docs/design.md"
        for section in re.findall(r'docs/design\.md, "([^"]+)"', text):
            assert section in headings, f"{path}: no section {section!r} in docs/design.md"
        for page in re.findall(r"docs/benchmarks/(\w+)\.md", text):
            assert (DOCS / "benchmarks" / f"{page}.md").is_file(), f"{path}: {page}.md"


README = ROOT / "README.md"


def test_the_readme_is_short_and_begins_with_the_two_set_up_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    head = "\n".join(lines[:40])
    assert "composer_lightning fit --config configs/" in head and "-m pytest" in head


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "examples/custom_head/README.md"])
def test_the_front_pages_links_resolve(page):
    """Relative links of the pages read outside the site (on the repository's front page)."""
    text = (ROOT / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            path = target.split("#")[0]
            assert path and (ROOT / page).parent.joinpath(path).exists(), f"{page}: {target}"


def test_the_plugin_example_points_at_the_one_list_of_requirements():
    """`examples/custom_head/README.md` names `REQUIREMENTS` instead of a copy of it."""
    from composer_lightning.heads import REQUIREMENTS

    text = (ROOT / "examples" / "custom_head" / "README.md").read_text()
    assert "REQUIREMENTS" in text
    assert sum(f"`{r}`" in text for r in REQUIREMENTS) <= 1


def test_the_configs_guide_lists_the_commands_the_cli_has():
    """`docs/guides/configs.md`'s table of commands and the CLI's usage name the same ones."""
    from composer_lightning.cli import USAGE

    text = (DOCS / "guides" / "configs.md").read_text()
    table = text[text.index("| command |") : text.index("## Sections")]
    first = re.findall(r"^\| (`[^|]+)\|", table, re.MULTILINE)
    listed = {name for cell in first for name in re.findall(r"`([a-z-]+)", cell)}
    assert listed == set(re.findall(r"^  ([a-z-]+) ", USAGE, re.MULTILINE))

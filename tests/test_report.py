"""The run report: the main job's configuration trained for a few steps (the HF engine instead
of vLLM, built once for the module), its files, the page's data, the command line and `--serve`;
and the page rendered in a real browser (Debian's headless Chromium): curves drawn, tokens
coloured, no console error, a screenshot that is not blank."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from composer_lightning.report.cli import resolve_run_dir
from composer_lightning.report.figures import figures, time_split
from composer_lightning.report.page import page_data, render, with_mixed, write_report
from composer_lightning.report.read import read_run, same_problems, sample_by_step
from composer_lightning.report.serve import ReportServer
from tests.chromium import Chromium, chromium_path
from tests.helpers import ROOT, run_cli, run_main

STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """configs/tiny_cpu.yaml (TokenDetails, held-out replies before the first step) for 6 steps
    with the HF engine, evaluated every 3 steps, per-token details and samples every 2."""
    root = tmp_path_factory.mktemp("report")
    config = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    rollout = config["rollout"]["init_args"]
    rollout["engine"] = {
        "class_path": "composer_lightning.engines.HFEngine",
        "init_args": {"seed": 0},
    }
    rollout["samples_every_n_steps"] = 2
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("TokenDetails"):
            callback["init_args"]["every_n_steps"] = 2
    (root / "tiny_cpu.yaml").write_text(yaml.safe_dump(config))
    out = run_cli(
        "fit",
        "--config",
        str(root / "tiny_cpu.yaml"),
        f"--trainer.max_steps={STEPS}",
        "--trainer.val_check_interval=3",
        "--model.grad_share_every_n_steps=2",
        "--data.init_args.val_prompts=16",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    where = root / "tiny_cpu" / "version_0"
    assert f"composer_lightning: run report in {where / 'report.html'}" in out.stdout
    return where


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_fit_writes_its_report_and_the_files_it_reads(run):
    assert (run / "report.html").stat().st_size > 0
    tokens = _rows(run / "tokens.jsonl")
    assert sorted({r["step"] for r in tokens}) == [0, 2, 4] and len(tokens) == 12
    assert all(len(r["tokens"]) == len(r["values"]["dr_grpo"]) for r in tokens)
    heldout = _rows(run / "heldout.jsonl")
    assert sorted({r["step"] for r in heldout}) == [0, 3, 6]  # before the first step, and after
    assert len(heldout) == 3 * 16 and all(isinstance(r["solved"], bool) for r in heldout)
    samples = _rows(run / "rollouts.jsonl")
    assert all(r["signal"][0] in ("opd_rl", "opd_only", "rl_only") for r in samples)
    checked = [r for r in samples if "teacher_reply" in r]  # the hint check's teacher
    assert checked and all(r["teacher_hint"] for r in checked)


def test_the_page_holds_what_the_run_logged_and_says_what_it_did_not(run):
    data = page_data(read_run(str(run)))
    drawn = {f["key"] for f in data["figures"] if "figure" in f}
    assert {"reward", "heldout", "length", "weights", "grad_share", "dispatch", "time"} <= drawn
    (kl,) = [f for f in data["figures"] if f["key"] == "kl_entropy"]
    assert "figure" not in kl and "a kl head" in kl["missing"]
    assert data["token_values"][0] == "mixed"
    assert {"dr_grpo", "opd", "sdpo/jsd"} <= set(data["token_values"])
    detailed = [r for r in data["rollouts"] if "details" in r]
    assert len(detailed) == 12
    hinted = [r for r in detailed if r["details"]["has_teacher"]]
    assert hinted and all(r["hint"] and r["details"]["teacher_logprobs"] for r in hinted)
    table = data["heldout"]
    assert table["steps"] == [0, 3, 6] and len(table["problems"]) == 16
    assert all(set(p["at"]) == {"0", "3", "6"} for p in table["problems"])  # the same problems
    assert data["run"]["glance"]["held-out accuracy"]["first"][0] == 0


def test_the_page_is_one_offline_file_of_a_few_mb(run):
    page = (run / "report.html").read_text()
    assert len(page.encode()) < 3_000_000
    for fetch in ("<script src=", "<link ", "@import", "<iframe"):  # nothing loaded from elsewhere
        assert fetch not in page


def test_report_command_writes_the_page_and_takes_the_newest_version(run, tmp_path, capfd):
    versions = tmp_path / "tiny_cpu"
    shutil.copytree(run, versions / "version_3")
    (versions / "version_1").mkdir()
    os.utime(versions / "version_1", (1, 1))  # older
    assert resolve_run_dir(str(versions)) == str(versions / "version_3")
    out = run_main(
        capfd, "report", str(versions), "--out", str(tmp_path / "r.html"), "--max-rows", "5",
        "--token-rows", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"composer_lightning: run report in {tmp_path / 'r.html'}"
    data = json.loads(_embedded((tmp_path / "r.html").read_text()))
    assert data["kept"]["rollouts"] == [4, 12]  # room for one step of 4 rows: the last
    assert {r["step"] for r in data["rollouts"]} == {4}


def test_report_of_a_missing_directory_is_one_line_naming_it(tmp_path, capfd):
    out = run_main(capfd, "report", str(tmp_path / "nowhere"))
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"composer_lightning: report: run directory '{tmp_path / 'nowhere'}' does not exist "
        "(or is not a directory)"
    )


def _embedded(page: str) -> str:
    tag = '<script id="report-data" type="application/json">'
    start = page.index(tag) + len(tag)
    return page[start : page.index("</script>", start)]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_serve_writes_the_page_again_when_a_step_lands(run, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(run, live)
    server = ReportServer(str(live), refresh_s=1.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
        before, stamp = _get(server.url), _get(server.url + "stamp")
        assert '"refresh_s": 1.0' in before and "A NEW STEP LANDED" not in before
        row = {"step": 99, "prompt": "p", "completion": "A NEW STEP LANDED", "reward": 1.0}
        with open(live / "rollouts.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        assert _get(server.url + "stamp") != stamp
        assert "A NEW STEP LANDED" in _get(server.url)
    finally:
        server.close()


def test_serve_from_the_command_line_says_where_and_serves_on_loopback(run):
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_lightning", "report", str(run), "--serve"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"composer_lightning: report of {run} at http://127.0.0.1:")
        url = line.split(" at ")[1].split()[0]
        assert "report-data" in _get(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_mixed_is_the_weighted_sum_of_the_advantage_heads_alone():
    """dr_grpo 1 × 0.5 + opd 0.5 × (1, −1) = (1, 0); SDPO's divergence is a loss head's
    metric, not an advantage, and is left out."""
    values = {"dr_grpo": [0.5, 0.5], "opd": [1.0, -1.0], "sdpo/jsd": [0.2, 0.1]}
    mixed = with_mixed(values, {"dr_grpo": 1.0, "opd": 0.5, "sdpo": 0.1})
    assert mixed == {"mixed": [1.0, 0.0], **values}
    assert with_mixed(values, None) == values


def test_rows_are_sampled_by_whole_steps_keeping_the_first_and_last():
    rows = [{"step": s, "i": i} for s in range(10) for i in range(4)]
    kept = sample_by_step(rows, 12)
    assert sorted({r["step"] for r in kept}) == [0, 4, 9] and len(kept) == 12
    assert sample_by_step(rows, 100) == rows


def test_heldout_rows_keep_the_first_evaluations_problems_at_every_step():
    rows = [{"step": 10, "prompt": "d", "completion": "x"}]  # not asked at step 0
    rows += [{"step": s, "prompt": p, "completion": "x"} for s in (0, 10) for p in "abc"]
    kept = sorted((r["step"], r["prompt"]) for r in same_problems(rows, 2))
    assert kept == [(0, "a"), (0, "b"), (10, "a"), (10, "b")]
    many = [{"step": s, "prompt": "a", "completion": "x"} for s in range(100)]
    assert [r["step"] for r in same_problems(many, 2, evaluations=4)] == [0, 33, 66, 99]


def test_the_step_time_is_split_into_its_parts_on_the_step_they_belong_to():
    """time/step and the push logged at step k are of step k − 1; generation of step k."""
    scalars = {
        "time/step": [(1, 10.0), (2, 12.0)],
        "rollout/push_time": [(1, 1.0), (2, 2.0)],
        "rollout/gen_time": [(0, 3.0), (1, 4.0), (2, 5.0)],
    }
    split = time_split(scalars)
    assert split == {
        "generate": [(0, 3.0), (1, 4.0)],
        "push": [(0, 1.0), (1, 2.0)],
        "update and the rest": [(0, 6.0), (1, 6.0)],
    }


def test_collapse_events_are_marked_on_every_curve():
    event = {"step": 7, "line": "held-out accuracy fell from 0.5 (step 0) to 0.1 (step 7)"}
    panels = figures({"rollout/reward_mean": [(0, 0.1), (9, 0.2)]}, [event])
    (reward,) = [p for p in panels if p["key"] == "reward"]
    layout = reward["figure"]["layout"]
    assert [s["x0"] for s in layout["shapes"]] == [7]
    assert layout["annotations"][0]["hovertext"] == event["line"]


def test_nothing_in_the_data_can_close_its_script_element(tmp_path):
    (tmp_path / "rollouts.jsonl").write_text(
        json.dumps(
            {"step": 0, "prompt": "</script><script>alert(1)</script>", "completion": "{{js}}"}
        )
        + "\n"
    )
    page = render(read_run(str(tmp_path)))
    data = json.loads(_embedded(page))
    assert data["rollouts"][0]["prompt"] == "</script><script>alert(1)</script>"
    assert data["rollouts"][0]["completion"] == "{{js}}"  # not a placeholder of the page


def _require_chromium() -> None:
    if chromium_path() is not None:
        return
    if os.environ.get("COMPOSER_REQUIRE_CHROMIUM"):
        pytest.fail("COMPOSER_REQUIRE_CHROMIUM is set and chromium is not installed (.ci/run)")
    pytest.skip("chromium is not installed: `apt-get install chromium` (.ci/run installs it)")


def test_the_main_jobs_report_renders_in_chromium(run, tmp_path):
    """Opened from disk in headless Chromium: every panel with data drew its plotly SVG with its
    traces, a reply's tokens carry background colours by the head chosen (and the colours follow
    a switch of head), the hint is shown, no console error or exception, and the screenshot is
    not blank."""
    _require_chromium()
    from PIL import Image

    page = write_report(str(run), str(tmp_path / "report.html"))
    expected = {f["key"] for f in page_data(read_run(str(run)))["figures"] if "figure" in f}
    with Chromium(width=1400, height=1000) as browser:
        ready = "document.body && (document.body.dataset.ready || document.body.dataset.error)"
        assert browser.open(f"file://{page}", ready) == "1", browser.errors
        panels = browser.evaluate(
            """Object.fromEntries([...document.querySelectorAll('.panel[data-panel]')].map(p =>
               [p.dataset.panel, [p.querySelectorAll('svg.main-svg').length,
                p.querySelectorAll('.scatterlayer .trace, .barlayer .trace').length]]))"""
        )
        drawn = {key for key, (svgs, traces) in panels.items() if svgs and traces}
        assert drawn == expected, panels
        colours = """[...document.querySelectorAll('#rollout-list .tok')].map(s =>
                      getComputedStyle(s).backgroundColor)"""
        mixed = browser.evaluate(colours)  # by default: every advantage head's weighted sum
        browser.evaluate("document.querySelector('input[name=colour][value=opd]').click()")
        opd = browser.evaluate(colours)
        assert opd != mixed and any(c.startswith("rgba(39, 174, 96") for c in opd)  # pushed up
        assert any(c.startswith("rgba(192, 57, 43") for c in opd)  # pushed down by OPD
        hover = browser.evaluate("document.querySelector('#rollout-list .tok').title")
        assert "hinted teacher log-prob" in hover or "student log-prob" in hover
        assert browser.evaluate("document.querySelectorAll('#rollout-list .hint').length") > 0
        browser.evaluate("document.querySelector('input[name=colour][value=dr_grpo]').click()")
        assert browser.evaluate(colours) != opd
        columns = browser.evaluate("document.querySelectorAll('#heldout-body th').length")
        assert columns == 1 + 3  # the problem, and after 0, 3 and 6 steps
        shot = Image.open(io.BytesIO(browser.screenshot())).convert("RGB")
        assert browser.errors == []
    assert shot.size == (1400, 1000)
    colors = shot.getcolors(maxcolors=1 << 20)
    assert len(colors) > 200  # text, curves and cards, not a blank page
    assert max(count for count, _ in colors) < 0.9 * shot.size[0] * shot.size[1]


def _episode_run(run_dir: Path) -> None:
    """A run directory with one tool episode in `rollouts.jsonl` and, beside it, a serve run's
    store of two sessions (one turn judged, one dropped as stale)."""
    from composer_lightning.serve.store import TurnStore

    run_dir.mkdir(parents=True)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    episode = {
        "step": 4,
        "messages": [
            {"role": "user", "content": "What is 2 + 3? Use the tool."},
            {"role": "assistant", "content": call, "reward": 0.5, "hint": "Now say the sum."},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "The answer is 5.", "reward": 1.0, "hint": None},
        ],
        "reward": 1.0,
        "status": "done",
        "signal": ["opd_rl", "rl_only"],
    }
    (run_dir / "rollouts.jsonl").write_text(json.dumps(episode) + "\n")
    store = TurnStore(run_dir.parent / "turns.sqlite")
    chat = [{"role": "user", "content": "Hi, what is 4 + 4?"}]
    first = store.record("alice", chat, [1, 2], [3], "It is 8.", [-0.1], version=3)
    store.record("bob", chat, [1, 2], [4], "It is 9.", [-0.2], version=1, drop_reason="stale")
    store.end_session("alice")  # ready to judge
    (claimed,) = store.claim_ready(1, claimant="judge")
    assert claimed.id == first
    store.set_judged(first, 1.0, None, claimant="judge")
    store.close()


def test_episodes_and_served_turns_render_in_chromium(tmp_path):
    """A tool episode shows each turn, its tool call and result, its next-state hint, score and
    signal; a serve run's turns show by session with their version, staleness and verdict."""
    _require_chromium()
    run_dir = tmp_path / "serve_run" / "version_0"
    _episode_run(run_dir)
    data = page_data(read_run(str(run_dir)))
    assert [(t["session"], t["version"], t["state"]) for t in data["turns"]] == [
        ("alice", 3, "judged"),
        ("bob", 1, "dropped"),
    ]
    page = write_report(str(run_dir))
    with Chromium(width=1200, height=900) as browser:
        ready = "document.body && (document.body.dataset.ready || document.body.dataset.error)"
        assert browser.open(f"file://{page}", ready) == "1", browser.errors
        turns = browser.evaluate(
            "[...document.querySelectorAll('#rollout-list .msg')].map(m => m.innerText)"
        )
        assert len(turns) == 4 and "tool" in turns[2] and "5" in turns[2]
        assert "add" in turns[1] and "Now say the sum." in turns[1] and "OPD + RL" in turns[1]
        served = browser.evaluate(
            "[...document.querySelectorAll('#served-body tbody tr')].map(r => r.innerText)"
        )
        assert len(served) == 2
        assert served[0].split("\t")[:5] == ["alice", "0", "3", "0", "judged"]
        assert served[1].split("\t")[:5] == ["bob", "0", "1", "2", "dropped (stale)"]
        assert browser.errors == []


def test_a_serve_runs_store_is_read_where_its_config_puts_it(tmp_path):
    run_dir = tmp_path / "serve_run" / "version_0"
    _episode_run(run_dir)
    store = tmp_path / "elsewhere" / "turns.sqlite"
    store.parent.mkdir()
    shutil.move(run_dir.parent / "turns.sqlite", store)
    assert read_run(str(run_dir)).turns == []
    config = {"rollout": {"init_args": {"store": str(store)}}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    assert [t["session"] for t in read_run(str(run_dir)).turns] == ["alice", "bob"]


def test_a_served_page_reloads_itself_when_a_step_lands(run, tmp_path):
    """`report --serve`'s page in Chromium: a row appended to the run shows up without a
    reload by hand, and the search typed before it is kept."""
    _require_chromium()
    live = tmp_path / "live"
    shutil.copytree(run, live)
    server = ReportServer(str(live), refresh_s=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Chromium(width=1200, height=800) as browser:
            ready = "document.body && (document.body.dataset.ready || document.body.dataset.error)"
            assert browser.open(server.url, ready) == "1", browser.errors
            browser.evaluate(
                """(() => { const s = document.getElementById('search');
                   s.value = 'LANDED'; s.dispatchEvent(new Event('input')); })()"""
            )
            row = {"step": 99, "prompt": "p", "completion": "A NEW STEP LANDED", "reward": 1.0}
            with open(live / "rollouts.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            shown = (
                "document.body.dataset.ready && document.getElementById('rollout-list').innerText"
            )
            text = browser.wait_until(shown, lambda t: "A NEW STEP LANDED" in (t or ""))
            assert "A NEW STEP LANDED" in text
            assert browser.evaluate("document.getElementById('search').value") == "LANDED"
            assert browser.errors == []
    finally:
        server.close()


def test_fit_adds_one_run_report_unless_the_config_has_its_own():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from composer_lightning.report.callback import RunReport, with_run_report

    other = ModelCheckpoint()
    (added,) = [c for c in with_run_report([other], [other]) if isinstance(c, RunReport)]
    assert added.limits["max_rows"] == 400
    mine = RunReport(max_rows=5)
    assert with_run_report([other, mine], []) == []
    assert with_run_report(mine, [other]) == [other]  # a single configured callback
    with pytest.raises(ValueError, match="RunReport.max_rows must be an integer >= 1, got 0"):
        RunReport(max_rows=0)

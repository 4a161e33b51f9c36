"""What the run report reads: the run's own files, sampled to stay small.

- scalars: TensorBoard's event files in the run directory (`events.out.tfevents.*`), else a CSV
  logger's `metrics.csv` — the same numbers TensorBoard shows;
- `rollouts.jsonl`: the sampled rollouts (`callbacks/samples.py`), episodes included;
- `tokens.jsonl`: each head's per-token values on a few replies (`TokenDetails`), when asked;
- `heldout.jsonl`: the greedy held-out replies of each evaluation (`rollout/validation.py`);
- `collapse.jsonl`: what `CollapseWatch` said, and at which step;
- `config.yaml`: the run's configuration as LightningCLI saved it;
- `turns.sqlite` (in the run directory or its parent): the turns a `serve` run served.

Rows are sampled by step (every row of the steps kept, the first and last steps always among
them), so a long run's report stays a few MB; what was kept of how many is recorded.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import sqlite3
from dataclasses import dataclass, field
from typing import Any

#: Scalars never drawn: Lightning's placeholder for hyper-parameter search.
_SKIPPED = {"hp_metric", "epoch", "step"}


@dataclass
class RunData:
    """Everything one report shows.

    Attributes:
        run_dir: the run directory read.
        scalars: each metric's `(step, value)` points, in step order.
        rollouts, tokens, heldout, collapse, turns: the rows kept of each file.
        config: the run's configuration (`config.yaml`), or empty.
        kept: per source, `(rows kept, rows read)`.
        files: the files read, relative to `run_dir`.
    """

    run_dir: str
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)
    heldout: list[dict[str, Any]] = field(default_factory=list)
    collapse: list[dict[str, Any]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, tuple[int, int]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def read_run(
    run_dir: str, max_rows: int = 400, max_token_rows: int = 200, heldout_problems: int = 16
) -> RunData:
    """Read a run directory for the report.

    Args:
        run_dir: a run's directory (`<save_dir>/<name>/version_<n>`: where its
            `rollouts.jsonl` and event files are).
        max_rows: rollout rows and served turns kept at most.
        max_token_rows: `tokens.jsonl` rows kept at most.
        heldout_problems: held-out problems whose replies are shown at every evaluation.

    Raises:
        FileNotFoundError: `run_dir` is not a directory.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist (or is not a directory)")
    for name, value in (
        ("max_rows", max_rows),
        ("max_token_rows", max_token_rows),
        ("heldout_problems", heldout_problems),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    data = RunData(run_dir=run_dir)
    data.scalars = read_scalars(run_dir, data.files)
    for name, limit in (("rollouts", max_rows), ("tokens", max_token_rows)):
        rows = read_jsonl(run_dir, f"{name}.jsonl", data.files)
        kept = sample_by_step(rows, limit)
        setattr(data, name, kept)
        data.kept[name] = (len(kept), len(rows))
    heldout = read_jsonl(run_dir, "heldout.jsonl", data.files)
    data.heldout = same_problems(heldout, heldout_problems)
    data.kept["heldout"] = (len(data.heldout), len(heldout))
    data.collapse = read_jsonl(run_dir, "collapse.jsonl", data.files)
    data.config = read_config(run_dir, data.files)
    rollout = (data.config.get("rollout") or {}).get("init_args") or {}
    store = rollout.get("store") if isinstance(rollout, dict) else None
    turns = read_turns(run_dir, data.files, store if isinstance(store, str) else None)
    data.turns = turns[-max_rows:]
    data.kept["turns"] = (len(data.turns), len(turns))
    return data


def read_jsonl(run_dir: str, name: str, files: list[str]) -> list[dict[str, Any]]:
    """The rows of `name` in `run_dir` (none if it is missing); a line cut short by a run that is
    still writing is skipped."""
    path = os.path.join(run_dir, name)
    if not os.path.isfile(path):
        return []
    files.append(name)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_scalars(run_dir: str, files: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run: TensorBoard's event files, else `metrics.csv`."""
    events = sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    series: dict[str, dict[int, float]] = {}
    if events:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for path in events:  # each file of a resumed or restarted run, in order
            files.append(os.path.basename(path))
            acc = EventAccumulator(path, size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags().get("scalars", []):
                for e in acc.Scalars(tag):
                    series.setdefault(tag, {})[int(e.step)] = float(e.value)
    elif os.path.isfile(os.path.join(run_dir, "metrics.csv")):
        files.append("metrics.csv")
        with open(os.path.join(run_dir, "metrics.csv"), encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                step = row.get("step")
                if not step:
                    continue
                for key, value in row.items():
                    if key != "step" and value not in ("", None):
                        series.setdefault(key, {})[int(float(step))] = float(value)
    return {
        key: sorted((s, v) for s, v in points.items() if math.isfinite(v))
        for key, points in sorted(series.items())
        if key not in _SKIPPED
    }


def sample_by_step(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """About `limit` rows at most: every row of evenly spaced steps, the first and the last
    step among them (a step's rows are read together); room for one step: the last."""
    if len(rows) <= limit:
        return rows
    steps = sorted({row.get("step", 0) for row in rows})
    k = max(1, min(len(steps), int(limit // (len(rows) / len(steps)))))
    if k == 1:
        chosen = {steps[-1]}
    else:
        chosen = {steps[round(i * (len(steps) - 1) / (k - 1))] for i in range(k)}
    return [row for row in rows if row.get("step", 0) in chosen]


def same_problems(
    rows: list[dict[str, Any]], problems: int, evaluations: int = 12
) -> list[dict[str, Any]]:
    """The held-out rows of the first `problems` problems of the first evaluation, at up to
    `evaluations` evenly spaced evaluations (the first and the last among them): the same
    prompts side by side, step by step."""
    if not rows:
        return []
    steps = sorted({row.get("step", 0) for row in rows})
    if len(steps) > evaluations:
        last = len(steps) - 1
        kept = {steps[round(i * last / (evaluations - 1))] for i in range(evaluations)}
        rows = [row for row in rows if row.get("step", 0) in kept]
    first = min(row.get("step", 0) for row in rows)
    chosen: list[str] = []
    for row in rows:
        key = problem_text(row)
        if row.get("step", 0) == first and key not in chosen:
            chosen.append(key)
    keep = set(chosen[:problems])
    return [row for row in rows if problem_text(row) in keep]


def problem_text(row: dict[str, Any]) -> str:
    """A row's prompt: its `prompt`, or an episode's first user message."""
    if "prompt" in row:
        return str(row["prompt"])
    users = [m.get("content", "") for m in row.get("messages", []) if m.get("role") == "user"]
    return str(users[0]) if users else ""


def read_config(run_dir: str, files: list[str]) -> dict[str, Any]:
    """The run's `config.yaml` (LightningCLI's copy), or {}."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError:
        return {}
    files.append("config.yaml")
    return config if isinstance(config, dict) else {}


def read_turns(run_dir: str, files: list[str], store: str | None = None) -> list[dict[str, Any]]:
    """The served turns of a `serve` run (its configured `store`, else `turns.sqlite` in the run
    directory or its parent), oldest first; read-only, and only the columns this report shows."""
    parent = os.path.dirname(os.path.abspath(run_dir))
    places = [store] if store else []
    places += [os.path.join(where, "turns.sqlite") for where in (run_dir, parent)]
    path = next((p for p in places if os.path.isfile(p)), None)
    if path is None:
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        db.row_factory = sqlite3.Row
        try:
            rows = db.execute("SELECT * FROM turns ORDER BY id").fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return []
    files.append(os.path.relpath(path, run_dir))
    wanted = ("id", "session", "turn_index", "version", "state", "reward", "hint")
    out = []
    for row in rows:
        turn = {k: row[k] for k in wanted + ("drop_reason", "response_text") if k in row.keys()}
        messages = json.loads(row["messages"]) if "messages" in row.keys() else []
        turn["prompt"] = messages[-1].get("content", "") if messages else ""
        turn["reply"] = turn.pop("response_text", "")
        out.append(turn)
    return out

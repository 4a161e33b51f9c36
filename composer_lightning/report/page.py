"""The report page: one self-contained HTML file (no server, no network), from `RunData`.

The page is static HTML with the run's data as one embedded JSON document, drawn by
`static/report.js` with plotly.js, which is embedded too. plotly.js (from the `plotly` Python
package) is 4.8 MB; embedded gzip-compressed (1.5 MB, 2.0 MB as base64) and unpacked by the
browser's own `DecompressionStream` (Chrome 80, Firefox 113, Safari 16.4 and later), the main
job's report stays ≈ 2 MB. `plain_js=True` embeds it as is, for a browser without
`DecompressionStream`, at ≈ 5 MB.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
import math
import os
import re
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from composer_lightning.report.figures import figures
from composer_lightning.report.read import RunData, problem_text, read_run

#: The dispatch's paths (`rollout/dispatch.py` PATHS) as the page says them.
SIGNAL_LABELS = {
    "opd_rl": "OPD + RL",
    "opd_only": "OPD only (no usable score)",
    "rl_only": "RL only (no teacher signal)",
    "dropped": "dropped",
}


@functools.cache
def plotly_js(compressed: bool) -> str:
    """plotly.js as the `plotly` package ships it: gzip + base64 when `compressed`."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    if not compressed:
        return js
    return base64.b64encode(gzip.compress(js.encode("utf-8"), 6, mtime=0)).decode("ascii")


def _static(name: str) -> str:
    return resources.files("composer_lightning.report").joinpath("static", name).read_text("utf-8")


def write_report(
    run_dir: str,
    out: str | None = None,
    *,
    max_rows: int = 400,
    max_token_rows: int = 200,
    heldout_problems: int = 16,
    plain_js: bool = False,
    refresh_s: float | None = None,
) -> str:
    """Read `run_dir` and write its report; returns the file's path.

    Args:
        run_dir: the run directory (where `rollouts.jsonl` and the event files are).
        out: the HTML file to write; None: `report.html` in `run_dir`.
        max_rows, max_token_rows, heldout_problems: how much is shown (`read.read_run`).
        plain_js: embed plotly.js uncompressed (≈ 5 MB) instead of gzip + base64.
        refresh_s: the page asks the server that serves it for changes every this many
            seconds and reloads on one (`report --serve`); None: a file, no polling.
    """
    data = read_run(run_dir, max_rows, max_token_rows, heldout_problems)
    page = render(data, plain_js=plain_js, refresh_s=refresh_s)
    out = out or os.path.join(run_dir, "report.html")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:  # a reader never sees half a page
        f.write(page)
    os.replace(tmp, out)
    return out


def render(
    data: RunData,
    *,
    plain_js: bool = False,
    refresh_s: float | None = None,
    stamp: str | None = None,
) -> str:
    """The page's HTML; `refresh_s` and `stamp` (the state of the run's files it was read
    from): the served page reloads when the server's stamp differs (`serve.py`)."""
    payload = finite(page_data(data) | {"refresh_s": refresh_s, "stamp": stamp})
    # `</` cannot close the script element that holds the JSON
    embedded = json.dumps(payload, ensure_ascii=False, allow_nan=False).replace("</", "<\\/")
    title = html.escape(payload["run"]["name"])
    if plain_js:
        library = f"<script>{plotly_js(False)}</script>"
    else:
        library = f'<script id="plotly-gz" type="text/plain">{plotly_js(True)}</script>'
    parts = {
        "title": title,
        "css": _static("report.css"),
        "library": library,
        "data": embedded,
        "js": _static("report.js"),
    }
    # one pass over the template: nothing inserted (a prompt, plotly.js) is read for `{{…}}`
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], _static("report.html"))


def finite(value: Any) -> Any:
    """`value` with every NaN or infinity as None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def page_data(data: RunData) -> dict[str, Any]:
    """What the page's script draws, as JSON."""
    return {
        "run": summary(data),
        "figures": figures(data.scalars, data.collapse),
        "collapse": data.collapse,
        "rollouts": rollout_rows(data.rollouts, data.tokens),
        "token_values": token_value_names(data.tokens),
        "heldout": heldout_table(data.heldout),
        "turns": data.turns,
        "signals": SIGNAL_LABELS,
        "kept": {k: list(v) for k, v in data.kept.items()},
        "files": data.files,
    }


def summary(data: RunData) -> dict[str, Any]:
    """The run at a glance: its name, heads, steps, and first → last of the key curves."""
    model = data.config.get("model") or {}
    # the heads by their metric names, at their effective weight of the last logged step
    heads = [
        {"name": key[: -len("/weight")], "weight": points[-1][1]}
        for key, points in data.scalars.items()
        if key.endswith("/weight") and points
    ]
    if not heads:  # no scalars yet: the configuration's classes
        for head in model.get("heads") or []:
            if isinstance(head, dict):
                args = head.get("init_args") or {}
                name = str(head.get("class_path", "?")).rsplit(".", 1)[-1]
                heads.append({"name": args.get("name") or name, "weight": args.get("weight", 1.0)})
    policy = model.get("policy")
    glance = {}
    for label, key in (
        ("reward", "rollout/reward_mean"),
        ("held-out accuracy", "val/accuracy"),
        ("reply length", "rollout/response_length_mean"),
        ("truncation", "rollout/truncation_rate"),
    ):
        points = data.scalars.get(key)
        if points:
            glance[label] = {"first": points[0], "last": points[-1], "n": len(points)}
    steps = max((p[-1][0] for p in data.scalars.values() if p), default=None)
    parts = os.path.abspath(data.run_dir).split(os.sep)
    return {
        "name": "/".join(parts[-2:]),
        "run_dir": os.path.abspath(data.run_dir),
        "written": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "policy": policy if isinstance(policy, str) else None,
        "heads": heads,
        "last_step": steps,
        "glance": glance,
    }


def rollout_rows(rollouts: list[dict[str, Any]], tokens: list[dict[str, Any]]) -> list[dict]:
    """The sample rows, each joined with its per-token details where `tokens.jsonl` has the same
    reply at the same step; a per-token row without a sample row is a row of its own."""
    rows = [dict(r) for r in rollouts]
    index = {(r.get("step"), str(r.get("completion", "")).strip()): r for r in rows}
    for detail in tokens:
        key = (detail.get("step"), str(detail.get("reply", "")).strip())
        row = index.get(key)
        if row is None or "details" in row:
            row = {
                "step": detail.get("step"),
                "prompt": detail.get("prompt", ""),
                "completion": detail.get("reply", ""),
                "reward": detail.get("reward"),
                "hint": detail.get("hint"),
            }
            rows.append(row)
            index.setdefault(key, row)
        row["details"] = {k: detail.get(k) for k in _DETAIL_KEYS}
        row["details"]["values"] = with_mixed(detail.get("values") or {}, detail.get("weights"))
        row.setdefault("signal", [detail.get("signal", "dropped")])
        if not row.get("hint") and detail.get("hint"):
            row["hint"] = detail["hint"]
    return sorted(rows, key=lambda r: r.get("step") or 0)


_DETAIL_KEYS = (
    "tokens",
    "values",
    "weights",
    "student_logprobs",
    "teacher_logprobs",
    "teacher_prompt",
    "has_teacher",
)


def with_mixed(values: dict[str, list[float]], weights: dict[str, float] | None) -> dict:
    """`values` and `mixed`: Σ weight × advantage over the advantage heads (the keys without a
    "/"; a head's own metric is `<head>/<metric>`), the advantage the surrogate trains each
    token on (the weights are the effective ones, after any variance or gradient matching)."""
    heads = [k for k in values if "/" not in k and weights and k in weights]
    if not heads or not weights:  # (heads are only found in weights)
        return values
    tokens = len(values[heads[0]])
    mixed = [
        round(sum(weights[h] * (values[h][i] or 0.0) for h in heads), 5) for i in range(tokens)
    ]
    return {"mixed": mixed, **values}


def token_value_names(tokens: list[dict[str, Any]]) -> list[str]:
    """Every per-token value any row has: `mixed` (`with_mixed`), each head's advantage, each
    `<head>/<metric>`."""
    names: list[str] = ["mixed"] if any(row.get("weights") for row in tokens) else []
    for row in tokens:
        for name in row.get("values") or {}:
            if name not in names:
                names.append(name)
    return names


def heldout_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out replies as a table: one row per problem, one column per evaluation."""
    steps = sorted({row.get("step", 0) for row in rows})
    problems: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = problems.setdefault(problem_text(row), {"prompt": problem_text(row), "at": {}})
        reply = row.get("completion")
        if reply is None:  # an episode: its assistant turns
            turns = [m for m in row.get("messages", []) if m.get("role") != "user"]
            reply = "\n".join(f"[{m.get('role')}] {m.get('content', '')}" for m in turns)
        entry["at"][str(row.get("step", 0))] = {
            "reply": reply,
            "solved": bool(row.get("solved")),
            "reward": row.get("reward"),
        }
    return {"steps": steps, "problems": list(problems.values())}

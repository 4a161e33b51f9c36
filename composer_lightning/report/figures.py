"""The report's curves: Plotly figures (plain JSON, drawn by plotly.js in the page) of the
run's scalars against the optimizer step, with what `CollapseWatch` said marked on each.

A panel whose metrics the run did not log says which setting logs them, instead of an empty
plot (a gradient share needs `model.grad_share_every_n_steps`, KL a `kl` head, …).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

#: Points per series at most: a long run's curves are strided down to this many.
MAX_POINTS = 2000

#: The step-time parts, as logged: each is of the step it is logged at but the push, which
#: (like `time/step`) is of the step before (`rollout/callback.py`).
_TIME_PARTS = {
    "generate": "rollout/gen_time",
    "hint check": "hint/check_time",
    "hinted replies": "hinted/gen_time",
    "wait for the engine": "rollout/wait_time",
}


@dataclass(frozen=True)
class Panel:
    """One plot: the metrics it draws, and the setting that logs them when none are there."""

    key: str
    title: str
    wanted: Callable[[str], bool]
    missing: str
    kind: Literal["lines", "stack"] = "lines"
    log_y: bool = False


def _head_term(k: str) -> bool:
    return k.endswith(("/adv_mean", "/loss")) and not k.startswith(("train/", "ppo/"))


PANELS: tuple[Panel, ...] = (
    Panel(
        "reward",
        "Reward (rollouts) and the hinted teacher's accuracy",
        lambda k: k in ("rollout/reward_mean", "hint/teacher_accuracy", "hint/student_accuracy"),
        "no rollout reward was logged",
    ),
    Panel(
        "heldout",
        "Held-out accuracy (greedy) and pass@k",
        lambda k: k.startswith("val/") and k != "val/response_length",
        "no held-out evaluation ran (trainer.val_check_interval, rollout.val_before_train)",
    ),
    Panel(
        "length",
        "Reply length (tokens)",
        lambda k: (
            k
            in (
                "rollout/response_length_mean",
                "rollout/response_length_max",
                "val/response_length",
            )
        ),
        "no reply length was logged",
    ),
    Panel(
        "truncation",
        "Truncated replies, and tool episodes without a call",
        lambda k: k in ("rollout/truncation_rate", "episode/no_call_rate"),
        "no truncation rate was logged",
    ),
    Panel(
        "weights",
        "Each head's effective weight",
        lambda k: k.endswith("/weight"),
        "no head weight was logged",
    ),
    Panel(
        "grad_share",
        "Each head's share of the gradient",
        lambda k: k.endswith("/grad_share"),
        "not measured in this run (model.grad_share_every_n_steps)",
    ),
    Panel(
        "terms",
        "Head terms (advantage heads: mean advantage; loss heads: loss)",
        _head_term,
        "no head term was logged",
    ),
    Panel(
        "dispatch",
        "Which signal the samples got (four-way dispatch)",
        lambda k: k.startswith("dispatch/"),
        "no dispatch counts were logged",
        kind="stack",
    ),
    Panel(
        "kl_entropy",
        "KL and entropy",
        lambda k: k.startswith("kl/") or k == "entropy" or k.endswith(("/kl", "/entropy")),
        "not logged in this run (a kl head; model.entropy_coef > 0)",
    ),
    Panel(
        "time",
        "Step time split (s): generate, hint check, push, and the update",
        lambda k: k == "time/step",
        "no step time was logged (it is logged from the second step on)",
        kind="stack",
    ),
    Panel(
        "staleness",
        "Staleness (weight versions between sampling and update)",
        lambda k: k == "rollout/staleness",
        "no staleness was logged",
    ),
    Panel(
        "canary",
        "Canary: |engine − trainer| log-prob gap",
        lambda k: k in ("rollout/logprob_gap_mean", "rollout/logprob_gap_max"),
        "no canary gap was logged",
        log_y=True,
    ),
    Panel(
        "loss",
        "Loss and gradient norm",
        lambda k: k in ("train/loss", "ppo/loss", "train/grad_norm", "ppo/clipfrac"),
        "no loss was logged",
    ),
)


def strided(points: list[tuple[int, float]], limit: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most about `limit` evenly spaced points, the last always kept."""
    if len(points) <= limit:
        return points
    stride = -(-len(points) // limit)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def time_split(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Each step's time in parts. `time/step` and `rollout/push_time` logged at step k are of
    step k − 1 (measured when step k starts), the other parts of the step they are logged at;
    "update and the rest" is the step's time less the parts."""
    total = {s - 1: v for s, v in scalars.get("time/step", [])}
    push = {s - 1: v for s, v in scalars.get("rollout/push_time", [])}
    parts = {name: dict(scalars.get(key, [])) for name, key in _TIME_PARTS.items()}
    parts = {name: values for name, values in parts.items() if values} | {"push": push}
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in parts}
    out["update and the rest"] = []
    for step in sorted(total):
        used = 0.0
        for name, values in parts.items():
            value = values.get(step, 0.0)
            out[name].append((step, value))
            used += value
        out["update and the rest"].append((step, max(total[step] - used, 0.0)))
    return {name: points for name, points in out.items() if points}


def figures(
    scalars: dict[str, list[tuple[int, float]]], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One entry per panel: `{"key", "title", "figure"}` with a Plotly figure, or `"missing"`
    (why nothing is drawn) where the run logged none of its metrics."""
    out = []
    for panel in PANELS:
        keys = sorted(k for k in scalars if panel.wanted(k))
        series = (
            time_split(scalars) if panel.key == "time" and keys else {k: scalars[k] for k in keys}
        )
        series = {k: v for k, v in series.items() if v}
        entry: dict[str, Any] = {"key": panel.key, "title": panel.title}
        if not series:
            out.append(entry | {"missing": panel.missing})
            continue
        entry["figure"] = figure(panel, series, events)
        out.append(entry)
    return out


def figure(
    panel: Panel, series: dict[str, list[tuple[int, float]]], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """A Plotly figure of `series` against the step, the collapse events as marked lines."""
    traces = []
    for name, points in series.items():
        points = strided(points)
        xs, ys = [s for s, _ in points], [v for _, v in points]
        trace: dict[str, Any] = {"name": name, "x": xs, "y": ys}
        if panel.kind == "stack":
            trace |= {"type": "bar"}
        else:
            trace |= {"type": "scatter", "mode": "lines+markers" if len(xs) < 40 else "lines"}
        traces.append(trace)
    layout: dict[str, Any] = {
        "title": {"text": panel.title, "font": {"size": 13}, "x": 0.01},
        "height": 280,
        "margin": {"l": 50, "r": 10, "t": 36, "b": 30},
        "legend": {"orientation": "h", "y": -0.18, "font": {"size": 10}},
        "xaxis": {"title": {"text": ""}, "zeroline": False},
        "yaxis": {"type": "log"} if panel.log_y else {},
        "shapes": [],
        "annotations": [],
        "hovermode": "x unified",
    }
    if panel.kind == "stack":
        layout["barmode"] = "stack"
        layout["bargap"] = 0.05
    for event in events:
        step, line = event.get("step", 0), str(event.get("line", ""))
        layout["shapes"].append(
            {
                "type": "line",
                "x0": step,
                "x1": step,
                "yref": "paper",
                "y0": 0,
                "y1": 1,
                "line": {"color": "#c0392b", "dash": "dot", "width": 2},
            }
        )
        layout["annotations"].append(
            {
                "x": step,
                "y": 1,
                "yref": "paper",
                "text": "collapse",
                "hovertext": line,
                "showarrow": False,
                "font": {"color": "#c0392b", "size": 10},
                "xanchor": "left",
            }
        )
    return {"data": traces, "layout": layout}

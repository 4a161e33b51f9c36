"""`TokenDetails`: each head's per-token push on a few replies per step, for the run report.

What a teacher signal does to a reply is invisible in a loss curve: OPD's `teacher − student`
gap and SDPO's divergence differ token by token, and exist only inside the training step. When
asked (this callback in `trainer.callbacks`), the first minibatch of every `every_n_steps`-th
step hands its head outputs to the callback (`Objective.observers`), which keeps `rows`
replies — one per group, hinted ones first, where the teacher heads have something to show —
and appends them to `tokens.jsonl` in the run directory, one JSON object per reply:

    {"step", "group", "prompt", "teacher_prompt", "hint", "reply", "tokens": [...],
     "reward", "has_reward", "has_teacher", "signal", "weights": {head: w},
     "values": {"<advantage head>": [...], "<loss head>/<metric>": [...]},
     "student_logprobs": [...], "teacher_logprobs": [...] | null}

`values` holds each advantage head's per-token advantage and each per-token metric a head
fills (`HeadOutput.token_metrics`, e.g. `sdpo/jsd`), one number per reply token. Without the
callback nothing is observed and nothing is written. Rank 0 writes its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import lightning as L
import torch
from torch import Tensor

from composer_lightning.runtime.rundir import append_rows

T = TypeVar("T")

#: The four-way dispatch's paths by (has_reward, has_teacher), named as `rollout/dispatch.py`
#: names them (that room is above this one).
SIGNALS = {
    (True, True): "opd_rl",
    (False, True): "opd_only",
    (True, False): "rl_only",
    (False, False): "dropped",
}


class TokenDetails(L.Callback):
    """Write each head's per-token values on `rows` replies of every `every_n_steps`-th step to
    `tokens.jsonl` in the run directory (the run report colours the replies' tokens by them).

    Args:
        rows: replies per step, one per group, hinted ones first (>= 1).
        every_n_steps: the steps whose replies are written (every step: 1).
        filename: the file's name in the run directory.
    """

    def __init__(self, rows: int = 4, every_n_steps: int = 1, filename: str = "tokens.jsonl"):
        for name, value in (("rows", rows), ("every_n_steps", every_n_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TokenDetails.{name} must be an integer >= 1, got {value!r}")
        self.rows, self.every_n_steps, self.filename = rows, every_n_steps, filename
        self._armed, self._step = False, 0
        self._captured: list[dict[str, Any]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        observers = getattr(getattr(pl_module, "objective", None), "observers", None)
        if observers is None:
            raise ValueError(
                f"TokenDetails observes a ComposerModule's objective; {type(pl_module).__name__} "
                "has no `objective.observers`"
            )
        if self._observe not in observers:
            observers.append(self._observe)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        observers = getattr(getattr(pl_module, "objective", None), "observers", [])
        if self._observe in observers:
            observers.remove(self._observe)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step  # the step of the batch's rows in `rollouts.jsonl`
        due = trainer.global_step % self.every_n_steps == 0
        self._armed = due and trainer.is_global_zero and bool(trainer.loggers)
        self._captured = []

    def _observe(
        self, batch: Any, ctx: Any, outputs: dict[str, Any], weights: dict[str, float]
    ) -> None:
        if not self._armed:
            return
        self._armed = False  # the step's first minibatch only
        with torch.no_grad():
            self._captured = capture(batch, ctx, outputs, weights, self.rows)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not self._captured:
            return
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        rows = [{"step": self._step} | decoded(row, tokenizer) for row in self._captured]
        self._captured = []
        append_rows(trainer, self.filename, rows)


def pick_rows(group_ids: list[int], has_teacher: list[bool], n: int) -> list[int]:
    """Up to `n` rows, the first of each group, the groups with a hinted row first (in batch
    order within each kind)."""
    first: dict[int, int] = {}
    for b, g in enumerate(group_ids):
        first.setdefault(g, b)
    return sorted(first.values(), key=lambda b: (not has_teacher[b], b))[:n]


def capture(
    batch: Any, ctx: Any, outputs: dict[str, Any], weights: dict[str, float], n: int
) -> list[dict[str, Any]]:
    """The chosen rows' token ids and per-token values (plain lists), from one minibatch's
    `RolloutBatch`, `StepContext` and head outputs."""
    B = batch.input_ids.shape[0]
    has_teacher = (
        batch.has_teacher if batch.has_teacher is not None else torch.zeros(B, dtype=torch.bool)
    )
    teacher_lp = ctx.teacher_logprobs if ctx.has("teacher_logprobs") else None
    out = []
    for b in pick_rows(batch.group_ids.tolist(), has_teacher.tolist(), n):
        pos = batch.response_mask[b].nonzero().flatten()  # [R] the reply's token positions
        if not len(pos):  # a reply masked out of every loss (truncated, masked)
            continue
        first = int(pos[0])
        attended = batch.attention_mask[b, :first].bool()
        values: dict[str, list[float]] = {}
        for name, head in outputs.items():
            if head.advantages is not None:
                values[name] = _at(head.advantages[b], pos)
            for key, metric in head.token_metrics.items():
                values[f"{name}/{key}"] = _at(metric[b], pos)
        hinted = bool(has_teacher[b])
        row = {
            "group": int(batch.group_ids[b]),
            "prompt_ids": batch.input_ids[b, :first][attended].tolist(),
            "token_ids": batch.input_ids[b, pos].tolist(),
            "reward": float(batch.rewards[b]) if bool(batch.has_reward[b]) else None,
            "has_reward": bool(batch.has_reward[b]),
            "has_teacher": hinted,
            "signal": SIGNALS[(bool(batch.has_reward[b]), hinted)],
            "weights": {k: round(float(w), 6) for k, w in weights.items()},
            "values": values,
            "student_logprobs": _at(ctx.old_logprobs[b], pos),
            "teacher_logprobs": _at(teacher_lp[b], pos)
            if hinted and teacher_lp is not None
            else None,
            "teacher_prompt_ids": None,
        }
        if hinted and batch.teacher_input_ids is not None:
            start = int(batch.teacher_positions[b, first])  # the reply's first teacher position
            if start > 0:
                kept = batch.teacher_attention_mask[b, :start].bool()
                row["teacher_prompt_ids"] = batch.teacher_input_ids[b, :start][kept].tolist()
        out.append(row)
    return out


def _at(values: Tensor, positions: Tensor) -> list[float]:
    return [round(float(v), 5) for v in values[positions].float().cpu()]


def decoded(row: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """A captured row as `tokens.jsonl` holds it: texts instead of ids (each reply token on its
    own, so the report can colour it), and the hint as the text the teacher's context adds."""
    ids, prompt_ids, teacher_ids = row["token_ids"], row["prompt_ids"], row["teacher_prompt_ids"]

    def text(tokens: list[int], special: bool = False) -> str:
        if tokenizer is None:  # no tokenizer to read them with: the ids
            return " ".join(map(str, tokens))
        return tokenizer.decode(tokens, skip_special_tokens=not special)

    rest = {k: v for k, v in row.items() if not k.endswith("_ids")}
    return {
        "prompt": text(prompt_ids),
        "teacher_prompt": text(teacher_ids) if teacher_ids is not None else None,
        "hint": text(list(inserted(prompt_ids, teacher_ids))).strip() if teacher_ids else None,
        "reply": text(ids),
        "tokens": [text([t], special=True) for t in ids],  # EOS too: it is pushed as well
    } | rest


def inserted(before: Sequence[T], after: Sequence[T]) -> Sequence[T]:
    """What `after` adds to `before`: the part between their common prefix and suffix (the
    hint a teacher context splices into the prompt, wherever its template puts it). On token
    ids, a template's special tokens stay whole."""
    p = 0
    while p < min(len(before), len(after)) and before[p] == after[p]:
        p += 1
    s = 0
    while s < min(len(before), len(after)) - p and before[-1 - s] == after[-1 - s]:
        s += 1
    return after[p : len(after) - s]

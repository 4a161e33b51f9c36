"""Shared test helpers: tiny models, hand-made rollout batches, and the command line run as a
user runs it (`run_cli`) or inside the test process (`run_main`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from composer_lightning.engines import HFEngine
from composer_lightning.heads.base import Head, HeadOutput
from composer_lightning.models.factory import TinyLlama
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext
from composer_lightning.training.module import ComposerModule

ROOT = Path(__file__).resolve().parents[1]  # the repository


def run_cli(
    *args: str, pythonpath: str | None = None, cwd: Path = ROOT, env: dict | None = None
) -> subprocess.CompletedProcess:
    # nothing is downloaded
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "composer_lightning", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_main(capfd, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m composer_lightning ARGS` run inside the test process, with its exit status
    and its output as `run_cli` returns them: for a run that ends at its configuration (a
    one-line error, `--print_config`) before any model is trained or engine started. It saves
    a new interpreter's imports (≈ 7 s) per case; a run that trains or starts vLLM (which
    changes the process it runs in) takes `run_cli`. The environment and working directory
    (`cwd`) are `run_cli`'s, and put back afterwards."""
    from unittest import mock

    from composer_lightning.cli import main

    capfd.readouterr()  # what the test printed before is not the run's
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # the arguments go to main(); pytest's own are not the run's (LightningCLI warns on both)
    with mock.patch.dict(os.environ, env), mock.patch.object(sys, "argv", sys.argv[:1]):
        with contextlib.chdir(cwd):
            status = _main_status(main, list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["composer_lightning", *args], status, out, err)


def _main_status(main, args: list[str]) -> int:
    """`main(args)`'s exit status as the interpreter gives it: a `SystemExit` message is
    printed to stderr with status 1."""
    try:
        return int(main(args) or 0)
    except SystemExit as exc:
        if isinstance(exc.code, int | None):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU `Trainer` that prints and writes nothing of its own (no logger, progress bar or
    model summary), checkpointing only with a `ModelCheckpoint` among its `callbacks`;
    `kwargs` go to `L.Trainer` and win over these defaults."""
    callbacks = kwargs.get("callbacks") or []
    checkpoints = any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks)
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**(defaults | kwargs))


def fit_trainer_stub(**attrs: Any) -> SimpleNamespace:
    """What `check_trainer_options` reads of a trainer in a fit, with Lightning's defaults
    (no clip, no accumulation); `attrs` add or replace fields (`strategy`, `precision`)."""
    return SimpleNamespace(
        state=SimpleNamespace(fn="fit"),
        gradient_clip_val=None,
        accumulate_grad_batches=1,
        **attrs,
    )


def tiny_model(
    dtype: torch.dtype = torch.float64, seed: int = 0, vocab_size: int = 64
) -> nn.Module:
    return TinyLlama(
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=1,
        num_heads=1,
        intermediate_size=64,
        seed=seed,
    ).to(dtype)


class ScriptedTeacher(nn.Module):
    """A frozen teacher whose logits are given: it checks it is asked about the expected context.

    HF-style: its final hidden states are the logits and its LM head is the identity.
    """

    def __init__(self, expected_ids: Tensor, logits: Tensor):
        super().__init__()
        self.expected_ids, self.logits = expected_ids, logits
        V = logits.shape[-1]
        self.head = nn.Linear(V, V, bias=False, dtype=logits.dtype)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(V, dtype=logits.dtype))
        self.calls = 0

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(self, input_ids: Tensor, **_: object) -> SimpleNamespace:
        assert torch.equal(input_ids, self.expected_ids), (
            "teacher asked about an unexpected context"
        )
        self.calls += 1
        return SimpleNamespace(hidden_states=(self.logits,))


def full_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """`[B, T, V]` logits of a causal LM the plain way (an independent reference for the
    chunked paths); position ids follow the attention mask."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits


def context(
    module: ComposerModule, batch: RolloutBatch, needs: set[str] | None = None
) -> StepContext:
    """The module's step context of `batch` as one rollout batch with one update."""
    if needs is None:
        needs = module.objective.requirements(module.objective.weights(module.global_step))
    return module.step_context(batch, needs)


def one_sample_batch(
    prompt: list[int],
    response: list[int],
    hint: list[int],
    *,
    reward: float,
    has_reward: bool,
    has_teacher: bool,
) -> RolloutBatch:
    """One sample (G = 1): prompt ⊕ response, teacher = prompt ⊕ hint ⊕ response."""
    P, R, H = len(prompt), len(response), len(hint)
    ids = torch.tensor([prompt + response])
    teacher_ids = torch.tensor([prompt + hint + response])
    pos = torch.arange(P + R)
    response_mask = (pos >= P).unsqueeze(0)
    positions = torch.where(response_mask, pos + H, -1)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response_mask,
        rewards=torch.tensor([reward]),
        has_reward=torch.tensor([has_reward]),
        group_ids=torch.tensor([0]),
        max_response_length=R,
        has_teacher=torch.tensor([has_teacher]),
        teacher_input_ids=teacher_ids,
        teacher_attention_mask=torch.ones_like(teacher_ids),
        teacher_positions=positions,
        sdpo_mask=response_mask & has_teacher,
    )


def teacher_logits_for(
    logprobs_target: Tensor, teacher_ids: Tensor, first_response_pos: int, vocab_size: int
) -> Tensor:
    """`[1, T', V]` logits under which token `teacher_ids[p]` has log-prob `logprobs_target[j]`
    at response position p = first_response_pos + j (the rest of the mass spread uniformly)."""
    T = teacher_ids.shape[1]
    probs = torch.full((1, T, vocab_size), 1.0 / vocab_size, dtype=torch.float64)
    for j, lp in enumerate(logprobs_target.tolist()):
        p = first_response_pos + j
        q = math.exp(lp)
        assert q < 1
        row = torch.full((vocab_size,), (1 - q) / (vocab_size - 1), dtype=torch.float64)
        row[teacher_ids[0, p]] = q
        probs[0, p - 1] = row
    return probs.log()


class StepMarker(L.Callback):
    """A callback (for CLI runs in tests) that prints `STEP <global_step>` after every step."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        print(f"STEP {trainer.global_step}", file=sys.stderr, flush=True)


class KillAt(L.Callback):
    """Kills its own process with SIGKILL (no handler runs) when step `step` starts."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class LostPushEngine(HFEngine):
    """An engine whose pushes after the first are lost: it claims the version, keeps its weights
    (importable, so it also runs in a background engine's child process)."""

    def load_weights(self, weights, version: int) -> None:
        if self.weight_version == 0 and not getattr(self, "_loaded_once", False):
            self._loaded_once = True
            return super().load_weights(weights, version)
        self._version = int(version)


class BlindLostPushEngine(LostPushEngine):
    """A lost-push engine that cannot read its weights back (no fingerprint): only the
    log-prob gap can see what it lost."""

    weight_fingerprint = None


class HangingEngine(HFEngine):
    """An engine whose generation never returns (a hung engine process); it creates the file
    `marker` (if given) when a generation starts."""

    def __init__(self, *args, marker: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.marker = marker

    def generate(self, prompts, n, sampling):
        import time

        if self.marker is not None:
            open(self.marker, "w").close()
        time.sleep(3600)


class SignalAt(L.Callback):
    """Sends its own process `signum` (SIGTERM by default, as a scheduler does) when step
    `step` starts, on rank `rank` alone if given; the run stops at the end of that step. With
    `parent`, the signal goes to the process that started this one instead (a node's
    `torchrun` agent, as a scheduler signals a node)."""

    def __init__(self, step: int, signum: int = 15, rank: int | None = None, parent: bool = False):
        self.step, self.signum, self.rank, self.parent = step, signum, rank, parent

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            import os

            os.kill(os.getppid() if self.parent else os.getpid(), self.signum)


class ReadOnlyAt(L.Callback):
    """Makes directory `path` read-only at the end of step `step` (a read-only bind mount of
    it on itself, before the step's checkpoint: new writes there fail with EROFS, as on a disk
    the kernel remounted read-only). Needs root; the test unmounts it."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            import subprocess

            subprocess.run(["mount", "--bind", self.path, self.path], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", self.path], check=True)


class FillDiskAt(L.Callback):
    """Fills the filesystem of directory `path` up to `keep` free bytes (a file `filler`
    there) when step `step` starts: that step's checkpoint finds less room than it needs."""

    def __init__(self, step: int, path: str, keep: int):
        self.step, self.path, self.keep = step, path, keep

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            fill_disk(self.path, self.keep)


def fill_disk(path: str, keep: int) -> None:
    """Fill the filesystem of directory `path` up to `keep` free bytes (a file `filler`)."""
    import os

    stat = os.statvfs(path)
    with open(os.path.join(path, "filler"), "wb") as f:
        f.write(b"\0" * max(stat.f_bavail * stat.f_frsize - keep, 0))


class PrintStaleness(L.Callback):
    """Prints `STALENESS <step> <staleness>` after every step (for CLI runs in tests)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        value = trainer.callback_metrics.get("rollout/staleness")
        print(f"STALENESS {trainer.global_step - 1} {int(value)}", file=sys.stderr, flush=True)


def base_model_dir(tmp_path: Path) -> str:
    """A copy of the tiny policy whose tokenizer has no chat template (a base model's)."""
    from composer_lightning.models.tiny import tiny_policy_path, write_checksums

    out = tmp_path / "base_policy"
    shutil.copytree(tiny_policy_path(), out)
    (out / "chat_template.jinja").unlink()
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    write_checksums(out)
    return str(out)


def wait_gone(pgid: int) -> None:
    """Fails unless every process of group `pgid` is dead (a zombie waiting for init counts as
    dead); polls for at most ~10 s while SIGKILL is delivered."""
    for _ in range(100):
        ps = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,stat=,args="], capture_output=True)
        rows = [line.split(None, 3) for line in ps.stdout.decode().splitlines()]
        live = [r for r in rows if r[0] == str(pgid) and not r[2].startswith("Z")]
        if not live:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left behind: {live}")


def end_session(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the session `proc` leads (started with
    `start_new_session=True`: ranks, engine processes), reap `proc`, and fail unless every
    process of the session is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing of it left
        pass
    proc.wait()
    wait_gone(proc.pid)


class Fixed(Head):
    """An advantage head returning given values (for checking the objective, the teacher cap
    and gradient shares by hand)."""

    def __init__(self, name: str, advantages: torch.Tensor, weight: float = 1.0):
        super().__init__(name=name, weight=weight)
        self.advantages = advantages

    def compute(self, batch, ctx):
        return HeadOutput(advantages=self.advantages * batch.response_mask)

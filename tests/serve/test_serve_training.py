"""`serve` end to end: a real server process trained by talking to it through the `openai`
client; kill -9 and a restart lose no recorded turn and judge none twice; SIGTERM drains,
saves and exits."""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import openai
import pytest

from composer_lightning.tasks.feedback import FeedbackHint, FeedbackScore
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples" / "talk_to_train"))
import talk  # noqa: E402

pytestmark = pytest.mark.slow  # serve end to end: servers, vLLM, kill -9


def _paths(db: str) -> dict[str, int]:
    """The four dispatch paths of the judged turns, and the dropped ones."""
    rows = sqlite3.connect(db).execute(
        "SELECT reward IS NOT NULL, hint IS NOT NULL, state, drop_reason FROM turns"
    )
    out = {"opd_rl": 0, "opd_only": 0, "rl_only": 0, "dropped": 0}
    for reward, hint, state, reason in rows:
        if state == "dropped":
            out["dropped"] += reason == "no signal"
        elif state in ("judged", "trained"):
            out["opd_rl" if reward and hint else "opd_only" if hint else "rl_only"] += 1
    return out


def test_talking_to_the_endpoint_trains_the_policy_it_serves():
    figures = talk.main(["--steps", "40", "--heldout", "64"])
    assert figures["server_exit"] == 128 + signal.SIGTERM  # drained, saved, exited
    workdir = figures["workdir"]
    (last,) = [os.path.join(d, f) for d, _, fs in os.walk(workdir) for f in fs if f == "last.ckpt"]
    assert os.path.getsize(last) > 0
    assert figures["versions_seen"][-1] >= 40  # served with ever newer weights
    paths = _paths(os.path.join(workdir, "turns.sqlite"))
    assert all(paths[p] > 0 for p in paths), paths
    assert figures["heldout_after"] > figures["heldout_before"], figures


@pytest.mark.parametrize("kind", ["hint", "answer"])
def test_a_users_correction_is_the_verifiers_hint_or_the_answer(kind, monkeypatch):
    """A wrong answer's reply: "No, that is wrong. Hint: <correction>" (every fourth session only
    the hint), the correction the verifier's hint or, with `--correction answer`, the answer;
    a right one "Correct, thanks." — what `FeedbackScore` and `FeedbackHint` read."""
    monkeypatch.setitem(talk.TASK, "name", "chat_arithmetic")
    monkeypatch.setitem(talk.CORRECTION, "kind", kind)
    problem = talk.the_task().sample(random.Random(0))
    answer = int(problem["answer"])
    verdict = talk.the_task().verify(problem, f"It is {answer + 1}.")
    said = f"The correct answer is {answer}." if kind == "answer" else verdict.hint
    assert talk.reply(problem, f"It is {answer + 1}.", 0) == f"No, that is wrong. Hint: {said}"
    assert talk.reply(problem, f"It is {answer + 1}.", 3) == f"Hint: {said}"
    assert talk.reply(problem, f"It is {answer}.", 0) == "Correct, thanks."
    wrong = talk.reply(problem, f"It is {answer + 1}.", 0)
    turn = {"next_state": [{"role": "user", "content": wrong}]}
    assert FeedbackHint().hints([turn], [""]) == [said]
    assert FeedbackScore().score([turn], [""]) == [-1.0]


@pytest.mark.vllm
def test_serve_on_vllm_trains_while_it_serves_and_no_step_meets_a_push(capfd):
    """The same talk on `VLLMEngine` (`StepBackend`: continuous batching, pushes between
    replies): 6 steps served with ever newer weights, no engine error and no push that left
    cached prefixes of old weights behind ("Failed to reset prefix cache"). A step that met a
    weight load did both, in a first run of this talk; the race is timing-dependent here and
    pinned deterministically by test_step_backend's push test."""
    engine = "--rollout.init_args.engine.class_path=composer_lightning.engines.VLLMEngine"
    figures = talk.main(["--steps", "6", "--heldout", "16", f"--server-arg={engine}"])
    out = capfd.readouterr()
    log = out.out + out.err
    assert figures["server_exit"] == 128 + signal.SIGTERM
    assert figures["versions_seen"][-1] >= 6
    assert "engine VLLMEngine" in log
    assert "Traceback" not in log and "Failed to reset prefix cache" not in log, log[-3000:]


CHECKPOINT_EVERY_STEP = (
    '--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",'
    ' "init_args": {"every_n_train_steps": 1, "save_last": true}}]'
)


def _serve(workdir, env, *extra, callbacks=CHECKPOINT_EVERY_STEP, batch_size=4, out=None):
    """A `serve` process and its URL, once it serves; `out` gets the lines printed before."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "composer_lightning", "serve",
            "--config", str(ROOT / "configs" / "serve_cpu.yaml"),
            f"--trainer.default_root_dir={workdir}",
            f"--trainer.logger.init_args.save_dir={workdir}",
            f"--rollout.init_args.store={workdir}/turns.sqlite",
            f"--rollout.init_args.batch_size={batch_size}",
            "--rollout.init_args.score=tests.serve.judged.LoggedFeedbackScore",
            callbacks,
            *extra,
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env),
        start_new_session=True,
    )  # fmt: skip
    for line in proc.stdout:
        if out is not None:
            out.append(line.rstrip("\n"))
        if "serving" in line and "http://" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split(" at ")[1].strip()
    raise AssertionError(f"the server exited ({proc.wait()}) before it printed its address")


def _talk(url, sessions, name, until=None):
    """`sessions` conversations of two turns, the first judged by the second (`until`: stop
    talking once it is true, or once the server is gone)."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    problem = {"messages": [{"role": "user", "content": "What is 4 + 18?"}], "answer": 22}
    for n in range(sessions):
        if until is not None and until():
            return
        try:
            first = talk.ask(client, problem["messages"], f"{name}-{n}")
        except openai.APIConnectionError:
            if until is None:
                raise
            return
        answer = first.choices[0].message.content or ""
        follow = [
            *problem["messages"],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "No, that is wrong. Hint: the first digit is 2."},
        ]
        try:
            talk.ask(client, follow, f"{name}-{n}", done=True, max_tokens=4)
        except openai.APIConnectionError:
            if until is None:
                raise
            return


def test_kill_9_and_a_restart_keep_every_turn_and_judge_none_twice(tmp_path):
    log = tmp_path / "judged.log"
    env = {"JUDGED_LOG": str(log)}
    proc, url = _serve(tmp_path, env)
    _talk(url, 10, "a")
    db = str(tmp_path / "turns.sqlite")
    deadline = time.monotonic() + 60
    while (
        sqlite3.connect(db)
        .execute("SELECT COUNT(*) FROM turns WHERE state IN ('recorded', 'ready', 'judging')")
        .fetchone()[0]
        > 2
        or not any("last.ckpt" in fs for _, _, fs in os.walk(tmp_path))
    ) and time.monotonic() < deadline:
        time.sleep(0.1)  # most of them judged (two wait for their session's end), a step saved
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = sqlite3.connect(db).execute("SELECT id, state FROM turns").fetchall()
    judged_before = {i for i, s in before if s in ("judged", "trained", "dropped")}
    calls_before = log.read_text().split()
    (last,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "last.ckpt"]
    import torch

    restored = torch.load(last, map_location="cpu", weights_only=False)["composer"]
    proc, url = _serve(tmp_path, env, f"--ckpt_path={last}")
    try:
        first = talk.ask(openai.OpenAI(base_url=url, api_key="none"), [{"role": "user", "content": "1 + 1?"}], "c", done=True)  # fmt: skip
        # served only once the restored weights are in the engine (never the base weights),
        # under labels of the second launch: no label names the lost weights and these both
        label = re.fullmatch(r"weights-l(\d+)-v(\d+)", first.system_fingerprint)
        assert label and int(label[1]) == 2, first.system_fingerprint
        assert int(label[2]) >= restored["policy_version"] > 0
        _talk(url, 2, "b")
        time.sleep(1)
        after = sqlite3.connect(db).execute("SELECT id FROM turns").fetchall()
        assert {i for i, _ in before} <= {i for (i,) in after}  # every recorded turn is there
        calls_after = log.read_text().split()[len(calls_before) :]
        assert not judged_before & {int(i) for i in calls_after}  # none judged again
        assert len(calls_before) == len(set(calls_before))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM


def _trained(db: str, states: tuple[str, ...] = ("trained",)) -> set[int]:
    marks = ",".join("?" * len(states))
    rows = sqlite3.connect(db).execute(f"SELECT id FROM turns WHERE state IN ({marks})", states)
    return {i for (i,) in rows}


def _checkpointed(path: str) -> set[int]:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)["callbacks"]
    (serve,) = [v for k, v in state.items() if k.startswith("ServeCallback")]
    return set(serve["trained"])


def test_turns_of_steps_no_checkpoint_holds_are_trained_again_after_kill_9(tmp_path):
    """A checkpoint every 10 steps, kill -9 when step 14 starts: the turns steps 11-13 took are
    handed back after the restore, and the resumed steps 11-13 train on them; at the end the
    store's trained turns are exactly the checkpoint's."""
    env = {"JUDGED_LOG": str(tmp_path / "judged.log")}
    callbacks = (
        '--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",'
        ' "init_args": {"every_n_train_steps": 10, "save_last": true}},'
        ' {"class_path": "tests.helpers.SignalAt", "init_args": {"step": 13, "signum": 9}}]'
    )
    # no turn may go stale: clients that outrun a loaded trainer must not starve step 14
    fresh = "--rollout.init_args.max_staleness=1000"
    proc, url = _serve(tmp_path, env, fresh, callbacks=callbacks, batch_size=1)
    _talk(url, 40, "a", until=lambda: proc.poll() is not None)
    assert proc.wait(timeout=300) == -signal.SIGKILL
    db = str(tmp_path / "turns.sqlite")
    (last,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "last.ckpt"]
    kept, taken = _checkpointed(last), _trained(db, ("taken", "trained"))
    assert len(kept) == 10 and kept < taken and len(taken) >= 13  # steps 11-13 took turns
    assert _trained(db) == kept  # trained: what a checkpoint holds; the rest only taken
    proc, url = _serve(
        tmp_path, env, fresh, f"--ckpt_path={last}", "--trainer.max_steps=13",
        callbacks=callbacks, batch_size=1,
    )  # fmt: skip
    assert proc.wait(timeout=300) == 0
    lasts = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "last.ckpt"]
    last = max(lasts, key=os.path.getmtime)  # the resumed run's
    after = _trained(db)
    assert after == _checkpointed(last), "the store's trained turns are the checkpoint's"
    assert len(after) == 13 and kept < after
    # the resumed run is the store's second launch, a child of the first at version 10
    launches = sqlite3.connect(db).execute("SELECT id, parent, start_version FROM launches")
    assert sorted(launches) == [(1, None, 0), (2, 1, 10)]


def test_turns_taken_before_the_first_checkpoint_go_back_after_kill_9(tmp_path):
    """Issue 50, point 10: no checkpoint is configured; four users talk until steps took turns,
    kill -9, and a restart on the same store (no checkpoint to pass) hands every turn those
    steps took back to training: none stayed `trained`, since no checkpoint holds it. After the
    restarted run's SIGTERM the store's trained turns are exactly its `last.ckpt`'s. Without an
    api_key serve says at start that it is one tenant (issue 50, point 12)."""
    from composer_lightning.serve.access import SINGLE_TENANT_NOTICE

    env, db = {"JUDGED_LOG": str(tmp_path / "judged.log")}, str(tmp_path / "turns.sqlite")
    fresh = "--rollout.init_args.max_staleness=1000"  # the restart is a new root: none stale
    lines: list[str] = []
    proc, url = _serve(tmp_path, env, fresh, callbacks="--trainer.callbacks=[]", out=lines)
    assert SINGLE_TENANT_NOTICE in lines
    steps_took = lambda: len(_trained(db, ("taken", "trained"))) >= 8  # noqa: E731  (two steps)
    users = [threading.Thread(target=_talk, args=(url, 100, f"u{k}", steps_took)) for k in range(4)]  # fmt: skip
    for user in users:
        user.start()
    for user in users:
        user.join()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    taken = _trained(db, ("taken", "trained"))
    assert len(taken) >= 8 and _trained(db) == set()  # no checkpoint holds their steps
    lines = []
    proc, url = _serve(tmp_path, env, fresh, callbacks="--trainer.callbacks=[]", out=lines)
    try:
        back = [line for line in lines if "go back to training" in line]
        assert back and back[0].startswith(f"{len(taken)} turns"), lines[-20:]
        _talk(url, 2, "after")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    (last,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "last.ckpt"]
    assert _trained(db) == _checkpointed(last)
    assert not taken & _trained(db, ("taken",)) - _checkpointed(last)  # none stuck as taken


def test_the_store_defaults_to_the_run_directory_and_its_directory_is_made(tmp_path):
    """No `rollout.store`: `turns.sqlite` in the logger's `<save_dir>/<name>` (shared by the
    versions a restart makes), else in `default_root_dir`; a given path's missing directory is
    made (the shipped config's relative store crashed a fresh clone)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from composer_lightning.serve.training import store_file

    logged = L.Trainer(
        default_root_dir=tmp_path / "root", logger=TensorBoardLogger(tmp_path / "runs", "serve")
    )
    assert store_file(logged, None) == str(tmp_path / "runs" / "serve" / "turns.sqlite")
    assert (tmp_path / "runs" / "serve").is_dir()
    bare = L.Trainer(default_root_dir=tmp_path / "root", logger=False)
    assert store_file(bare, None) == str(tmp_path / "root" / "turns.sqlite")
    given = tmp_path / "a" / "b" / "turns.sqlite"
    assert store_file(bare, str(given)) == str(given) and given.parent.is_dir()


def test_a_step_drops_stale_turns_and_stamps_the_batch_with_its_oldest_version(tmp_path):
    """At policy version 6 with max_staleness 4 a turn of version 1 is dropped ("stale") and
    turns of versions 5 and 3 are taken; their batch carries version 3 (its oldest), so every
    row is importance-corrected against its own engine log-probs."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from composer_lightning.chat import render_ids
    from composer_lightning.engines import HFEngine
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.serve.store import TurnStore
    from composer_lightning.serve.training import ServeCallback
    from composer_lightning.tasks.feedback import FeedbackScore

    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    cb = ServeCallback(HFEngine(model_path=tiny_policy_path()), batch_size=2, score=FeedbackScore())
    cb.store = TurnStore(tmp_path / "turns.sqlite")
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    prompt = render_ids(tok, messages, add_generation_prompt=True)
    ids = {}
    for version in (1, 5, 3):
        ids[version] = cb.store.record(
            f"s{version}", messages, prompt, [29, 1], "3", [-0.5, -0.1], version
        )
        cb.store.claim_ready(1, claimant="j")  # nothing is ready without a next state:
        cb.store.end_session(f"s{version}")  # ending the session makes it ready
        (turn,) = cb.store.claim_ready(1, claimant="j")
        cb.store.set_judged(turn.id, 1.0, None, claimant="j")
    trainer = SimpleNamespace(
        callbacks=[], _signal_connector=SimpleNamespace(received_sigterm=False)
    )
    turns = cb.take(trainer, version=6)
    assert [t.version for t in turns] == [5, 3]
    assert cb.store.get(ids[1]).drop_reason == "stale"
    assert cb.samples(turns, tok, version=6).policy_version == 3
    # the canary's rows: a turn the current weights sampled, among older ones
    current = cb.store.get(cb.store.record("s6", messages, prompt, [29, 1], "3", [-0.5, -0.1], 6))
    rb = cb.samples([current, *turns], tok, version=6)
    assert rb.on_policy_rows.tolist() == [True, False, False] and rb.policy_version == 3
    # the n choices of one request: one group in the batch (their mean reward the baseline)
    choices = [([29, 1], "3", [-0.5, -0.1]), ([30], "4", [-0.2])]
    group = [cb.store.get(i) for i in cb.store.record_choices("s7", messages, prompt, choices, 6)]
    assert cb.samples([current, *group], tok, version=6).group_ids.tolist() == [0, 1, 1]


def test_dispatch_dropped_counts_the_step_not_the_store():
    """`dispatch/dropped` is per step like the other dispatch paths: the drops since the last
    step (the store's own count runs since the store began)."""
    from composer_lightning.engines import HFEngine
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.serve.training import ServeCallback
    from composer_lightning.tasks.feedback import FeedbackScore

    cb = ServeCallback(HFEngine(model_path=tiny_policy_path()), score=FeedbackScore())
    cb._dropped_seen = 5  # what the store held when serving began
    steps = [cb.dropped_since_last_step({"dropped/no signal": n}) for n in (7, 7, 10)]
    assert steps == [2, 0, 3]


class _Judge:
    """A score provider down for its first `down` calls (it raises, as a judge endpoint that
    refuses connections makes it), then scoring every turn `value`."""

    def __init__(self, down: int, value: float | None = 1.0) -> None:
        self.down, self.value, self.calls = down, value, 0

    def score(self, problems, completions):
        self.calls += 1
        if self.calls <= self.down:
            raise ConnectionError("the judge is down")
        return [self.value] * len(problems)


def _judging(tmp_path, judge, **kwargs):
    from composer_lightning.engines import HFEngine
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.serve.store import TurnStore
    from composer_lightning.serve.training import ServeCallback

    cb = ServeCallback(HFEngine(model_path=tiny_policy_path()), score=judge, **kwargs)
    cb.store = TurnStore(tmp_path / f"turns-{judge.down}-{judge.value}.sqlite")
    for n in range(2):
        cb.store.record(f"s{n}", [{"role": "user", "content": "hi"}], [1], [2], "x", [-0.1], 0)
        cb.store.end_session(f"s{n}")
    return cb


def test_a_judge_outage_retries_its_turns_then_drops_them_as_judge_failed(tmp_path):
    """A judge that raises gives its turns back (claimable again after the backoff), so an
    outage shorter than the attempts loses nothing; a longer one drops them as "judge_failed",
    counted apart from "no signal" (a judge that answers None without failing)."""
    from composer_lightning.serve.training import JUDGE

    def rounds(cb, n):  # the judge thread's loop, n times
        for _ in range(n):
            turns = cb.store.claim_ready(16, claimant=JUDGE)
            if turns:
                cb.judge(turns)

    short = _judging(tmp_path, _Judge(down=2), judge_attempts=3, judge_backoff_s=0)
    rounds(short, 3)
    assert [(t.state, t.reward, t.attempts) for t in map(short.store.get, (1, 2))] == [
        ("judged", 1.0, 2),
        ("judged", 1.0, 2),
    ]
    long = _judging(tmp_path, _Judge(down=99), judge_attempts=3, judge_backoff_s=0)
    rounds(long, 5)
    counts = long.store.counts()
    assert (counts["dropped/judge_failed"], long.score.calls) == (2, 3)
    silent = _judging(tmp_path, _Judge(down=0, value=None), judge_attempts=3, judge_backoff_s=0)
    rounds(silent, 1)
    assert silent.store.counts()["dropped/no signal"] == 2
    waiting = _judging(tmp_path, _Judge(down=1, value=0.5), judge_attempts=3, judge_backoff_s=60)
    rounds(waiting, 1)
    assert waiting.store.claim_ready(16, claimant=JUDGE) == []  # backing off
    assert waiting.store.get(1).state == "ready"

"""TurnStore: a turn's life, durability across kill -9, exactly-once judging, staleness."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from composer_lightning.serve.store import TurnStore

STORE_FILE = str(Path(__file__).resolve().parents[2] / "composer_lightning" / "serve" / "store.py")
USER = {"role": "user", "content": "hi"}


def _record(store: TurnStore, session: str, messages: list, reply: str, version: int = 0) -> int:
    return store.record(session, messages, [1, 2], [3, 4], reply, [-0.5, -0.25], version)


def _judged(store: TurnStore, n: int) -> list[int]:
    """`n` one-turn sessions `s0`.. recorded, ended and judged (reward 1): their ids."""
    ids = [_record(store, f"s{i}", [USER], "r") for i in range(n)]
    for i in range(n):
        store.end_session(f"s{i}")
    for t in store.claim_ready(10, claimant="j"):
        store.set_judged(t.id, 1.0, None, claimant="j")
    return ids


def _child(code: str) -> subprocess.Popen:
    """A Python process running `code` with `TurnStore` in scope (store.py is loaded by path:
    it needs only the standard library, and the package would import torch)."""
    prelude = (
        "import importlib.util as u, sys\n"
        f"spec = u.spec_from_file_location('store', {STORE_FILE!r})\n"
        "store_module = u.module_from_spec(spec); sys.modules['store'] = store_module\n"
        "spec.loader.exec_module(store_module)\n"
        "TurnStore = store_module.TurnStore\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], stdout=subprocess.PIPE, text=True
    )


def _kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()


def test_a_turn_gets_the_messages_that_followed_it_as_next_state(tmp_path):
    store = TurnStore(tmp_path / "turns.db")
    t0 = _record(store, "s", [USER], "hello")
    turn1_request = [
        USER,
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "and?"},
    ]
    assert store.attach_next_state("s", turn1_request) == t0
    t1 = _record(store, "s", turn1_request, "bye")
    # The same reply after another context (an edited history) is not a continuation either.
    other_context = [{"role": "user", "content": "bye"}, *turn1_request[1:]]
    assert store.attach_next_state("s", [*other_context, {"role": "assistant", "content": "bye"}, USER]) is None  # fmt: skip
    # A regenerated reply is not a continuation: turn 1 keeps waiting.
    edited = [*turn1_request, {"role": "assistant", "content": "other"}, USER]
    assert store.attach_next_state("s", edited) is None
    assert store.attach_next_state("other-session", edited) is None

    first, second = store.session_turns("s")
    assert (first.id, first.turn_index, first.state, first.ready_reason) == (t0, 0, "ready", "next")
    assert first.next_state == turn1_request[2:]
    assert (second.id, second.turn_index, second.state, second.next_state) == (
        t1,
        1,
        "recorded",
        None,
    )

    assert store.end_session("s") == 1
    second = store.get(t1)
    assert (second.state, second.next_state, second.ready_reason) == ("ready", [], "session_done")

    _record(store, "quiet", [USER], "x")
    assert store.expire(older_than_s=3600) == 0
    assert store.expire(older_than_s=0) == 1
    assert store.session_turns("quiet")[0].ready_reason == "timeout"
    assert store.counts()["ready"] == 3 and store.counts()["sessions"] == 2


def test_a_recorded_turn_survives_kill_9(tmp_path):
    db = tmp_path / "turns.db"
    child = _child(
        f"""
        store = TurnStore({str(db)!r})
        for i in range(10**6):
            turn = store.record("s", [{{"role": "user", "content": str(i)}}], [1], [2], str(i), [-1.0], 0)
            print(turn, flush=True)
        """
    )
    try:
        returned = [int(child.stdout.readline()) for _ in range(30)]
    finally:
        _kill(child)
    store = TurnStore(db)
    stored = {t.id: t for t in store.session_turns("s")}
    assert set(returned) <= set(stored)  # and maybe a few more it recorded before dying
    assert [stored[i].response_text for i in returned] == [str(i) for i in range(30)]


def test_judging_is_exactly_once_across_a_judge_killed_mid_claim(tmp_path):
    db = tmp_path / "turns.db"
    store = TurnStore(db)
    ids = [_record(store, f"s{i}", [USER], f"r{i}") for i in range(4)]
    for i in range(4):
        store.end_session(f"s{i}")
    child = _child(
        f"""
        import time
        store = TurnStore({str(db)!r})
        claimed = store.claim_ready(2, claimant="judge")
        assert store.set_judged(claimed[0].id, 1.0, "fine", claimant="judge")
        print(*[t.id for t in claimed], flush=True)
        time.sleep(60)  # killed here, before judging the second turn
        """
    )
    try:
        judged, unfinished = map(int, child.stdout.readline().split())
    finally:
        _kill(child)
    assert (judged, unfinished) == tuple(ids[:2])

    store = TurnStore(db)
    # Another judge gets only the never-claimed turns while the dead claim's lease holds.
    other = store.claim_ready(10, claimant="other")
    assert [t.id for t in other] == ids[2:]
    assert not store.set_judged(unfinished, 0.0, None, claimant="other")
    # The restarted judge re-claims exactly its unfinished turn, never the judged one.
    assert store.claim_ready(10, claimant="judge") == []
    again = store.reclaim("judge")
    assert [t.id for t in again] == [unfinished]
    assert store.set_judged(unfinished, None, "hint", claimant="judge")
    assert not store.set_judged(unfinished, 5.0, None, claimant="judge")  # judged once
    for t in other:
        assert store.set_judged(t.id, 0.5, None, claimant="other")
    assert store.reclaim("judge") == [] and store.reclaim("other") == []
    assert store.claim_ready(10, claimant="anyone", lease_s=0) == []
    verdicts = {t.id: (t.reward, t.hint) for t in (store.get(i) for i in ids)}
    assert verdicts == {
        ids[0]: (1.0, "fine"),
        ids[1]: (None, "hint"),
        ids[2]: (0.5, None),
        ids[3]: (0.5, None),
    }
    assert store.counts()["judged"] == 4


def test_a_claim_whose_lease_passed_goes_to_another_judge(tmp_path):
    store = TurnStore(tmp_path / "turns.db")
    tid = _record(store, "s", [USER], "r")
    store.end_session("s")
    assert [t.id for t in store.claim_ready(1, claimant="dead")] == [tid]
    assert store.claim_ready(1, claimant="alive") == []
    assert [t.id for t in store.claim_ready(1, claimant="alive", lease_s=0)] == [tid]
    assert not store.set_judged(tid, 1.0, None, claimant="dead")
    assert store.set_judged(tid, 1.0, None, claimant="alive")


def test_concurrent_claims_from_two_connections_are_disjoint(tmp_path):
    db = tmp_path / "turns.db"
    store = TurnStore(db)
    for i in range(200):
        _record(store, f"s{i}", [USER], "r")
        store.end_session(f"s{i}")
    got: dict[str, list[int]] = {"a": [], "b": []}

    def judge(name: str) -> None:
        mine = TurnStore(db)
        while batch := mine.claim_ready(3, claimant=name):
            got[name] += [t.id for t in batch]

    threads = [threading.Thread(target=judge, args=(n,)) for n in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(got["a"]) & set(got["b"])
    assert sorted(got["a"] + got["b"]) == list(range(1, 201))


def test_take_judged_drops_stale_turns_and_counts_them(tmp_path):
    store = TurnStore(tmp_path / "turns.db")
    ids = [_record(store, f"s{v}", [USER], "r", version=v) for v in (0, 1, 2, 3)]
    for v in range(4):
        store.end_session(f"s{v}")
    for t in store.claim_ready(10, claimant="j"):
        store.set_judged(t.id, float(t.version), None, claimant="j")
    taken = store.take_judged(1, min_version=2)
    assert [t.id for t in taken] == [ids[2]] and taken[0].state == "taken"
    counts = store.counts()
    assert (counts["dropped"], counts["dropped/stale"], counts["judged"]) == (2, 2, 1)
    assert [t.id for t in store.take_judged(10)] == [ids[3]]
    assert store.take_judged(10) == []
    assert store.get(ids[0]).drop_reason == "stale"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.claim_ready(0, claimant="j"), "limit must be >= 1, got 0"),
        (lambda s: s.claim_ready(1, claimant=""), "claimant must be a non-empty"),
        (lambda s: s.take_judged(0), "limit must be >= 1, got 0"),
        (lambda s: s.expire(-1), "older_than_s must be >= 0 seconds, got -1"),
        (lambda s: s.record("s", [USER], [1], [2, 3], "r", [-1.0], 0), "1 log-probs for 2"),
    ],
)
def test_bad_arguments_name_the_value(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(TurnStore(tmp_path / "turns.db"))


def test_a_store_written_before_judge_retries_opens_and_gains_their_columns(tmp_path):
    """A store from before `attempts` / `retry_at` / `launch` existed: opened, the columns are added and
    its turns keep their states (the turns of a running deployment are not lost on upgrade)."""
    import sqlite3

    from composer_lightning.serve import store as store_module

    old = store_module._SCHEMA.replace(
        "    attempts INTEGER NOT NULL DEFAULT 0,\n    retry_at REAL,\n", ""
    )
    assert old != store_module._SCHEMA
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(old)
    db.execute(
        "INSERT INTO turns (session, turn_index, messages, prompt_ids, response_ids, "
        "response_text, logprobs, version, created, state) "
        "VALUES ('s', 0, '[]', '[1]', '[2]', 'x', '[-0.1]', 0, 0, 'ready')"
    )
    db.commit()
    db.close()
    store = TurnStore(path)
    (turn,) = store.claim_ready(1, claimant="j")
    assert (turn.state, turn.attempts, turn.launch) == ("judging", 0, 0)  # 0: before launches
    assert store.launches() == {} and store.begin_launch(None, 0) == 1
    assert store.release(turn.id, claimant="j", retry_after_s=0) == 1


def test_launch_ids_are_never_reused_and_keep_their_parent(tmp_path):
    """Each start of a run is a new launch id, also after the store is reopened; a turn keeps
    the launch that served it."""
    store = TurnStore(tmp_path / "turns.db")
    first = store.begin_launch(None, 0)
    second = store.begin_launch(first, 10)
    store.close()
    store = TurnStore(tmp_path / "turns.db")
    third = store.begin_launch(first, 10)
    assert (first, second, third) == (1, 2, 3)
    assert store.launches() == {1: (None, 0), 2: (1, 10), 3: (1, 10)}
    turn = store.record("s", [USER], [1], [2], "r", [-1.0], 11, launch=third)
    assert store.get(turn).launch == 3


def test_the_choices_of_one_request_are_one_group_judged_apart_and_trained_together(tmp_path):
    """n = 3 choices: three turns of one group; the next request continues choice 1, which gets
    the next state while 0 and 2 get an empty one ("not_continued"); training takes the group
    only once none of it waits for a judge, whole (never split by `limit`), without the
    members dropped meanwhile."""
    store = TurnStore(tmp_path / "turns.db")
    choices = [([3, 4], text, [-0.5, -0.25]) for text in ("a", "b", "c")]
    ids = store.record_choices("s", [USER], [1, 2], choices, 0)
    alone = _record(store, "t", [USER], "solo")
    turns = store.session_turns("s")
    assert [t.group for t in turns] == [ids[0]] * 3 and [t.choice for t in turns] == [0, 1, 2]
    assert [t.turn_index for t in turns] == [0, 1, 2]
    follow = [USER, {"role": "assistant", "content": "b"}, {"role": "user", "content": "ok"}]
    assert store.attach_next_state("s", follow) == ids[1]
    got = {t.id: (t.state, t.next_state, t.ready_reason) for t in store.session_turns("s")}
    assert got[ids[1]] == ("ready", [{"role": "user", "content": "ok"}], "next")
    assert got[ids[0]] == got[ids[2]] == ("ready", [], "not_continued")
    store.end_session("t")
    claimed = store.claim_ready(10, claimant="j")
    for t in claimed:
        if t.id != ids[2]:
            store.set_judged(t.id, 1.0, None, claimant="j")
    # choice 2 still judging: its group waits, the turn of session t does not
    assert [t.id for t in store.take_judged(10)] == [alone]
    store.drop(ids[2], "no signal", claimant="j")
    assert [t.id for t in store.take_judged(1)] == [ids[0], ids[1]]  # whole, over the limit


def test_a_turn_is_trained_only_once_a_checkpoint_holds_it(tmp_path):
    """Issue 50, point 10: turns a step takes are `taken` until a checkpoint holding that step
    is written (`trained`); a start without a checkpoint to restore (a crash before the first)
    hands every `taken` turn back and keeps the `trained` ones, a start from a checkpoint keeps
    exactly the turns it holds."""
    db = tmp_path / "turns.db"
    store = TurnStore(db)
    ids = _judged(store, 6)
    step1 = [t.id for t in store.take_judged(2)]
    assert store.confirm_trained(step1) == 2  # a checkpoint holding step 1 was written
    step2 = [t.id for t in store.take_judged(2)]  # no checkpoint holds step 2
    assert store.confirm_trained(step1) == 0  # confirmed once
    store.close()
    store = TurnStore(db)  # the restart: no checkpoint to restore
    assert store.untrain(keep=None) == 2
    assert [store.get(i).state for i in ids] == ["trained"] * 2 + ["judged"] * 4
    again = [t.id for t in store.take_judged(4)]
    assert again == step2 + ids[4:]
    # a restart from the checkpoint of step 1 (its steps took step1): every other turn goes back
    assert store.untrain(keep=step1) == 4
    assert [store.get(i).state for i in ids] == ["trained"] * 2 + ["judged"] * 4
    store.take_judged(2)
    assert store.untrain(keep=[*step1, *step2]) == 0  # a checkpoint that holds them: trained
    assert [store.get(i).state for i in ids] == ["trained"] * 4 + ["judged"] * 2


def test_a_step_stopped_while_filling_gives_its_turns_back(tmp_path):
    """A stop (SIGTERM) while a step's batch is still filling: the turns it took go back to
    `judged` at once, so no turn stays `taken` by a step that never trains (the CI saw turns
    stuck `taken` after a clean stop under load); a trained turn is not touched."""
    store = TurnStore(tmp_path / "turns.db")
    ids = _judged(store, 4)
    trained = [t.id for t in store.take_judged(1)]
    store.confirm_trained(trained)
    partial = [t.id for t in store.take_judged(2)]
    assert store.give_back([*partial, *trained]) == 2
    assert [store.get(i).state for i in ids] == ["trained", "judged", "judged", "judged"]
    assert [t.id for t in store.take_judged(3)] == partial + ids[3:]


def test_take_judged_never_splits_a_group_to_fill_a_batch(tmp_path):
    store = TurnStore(tmp_path / "turns.db")
    first = _record(store, "a", [USER], "x")
    group = store.record_choices("b", [USER], [1, 2], [([3], "y", [-0.1])] * 2, 0)
    last = _record(store, "c", [USER], "z")
    for session in "abc":
        store.end_session(session)
    for t in store.claim_ready(10, claimant="j"):
        store.set_judged(t.id, 0.5, None, claimant="j")
    assert [t.id for t in store.take_judged(2)] == [first]  # the group would not fit
    assert [t.id for t in store.take_judged(2)] == group
    assert [t.id for t in store.take_judged(2)] == [last]


def test_the_store_is_readable_by_its_owner_only(tmp_path):
    """It holds what clients said: 0600 for the file and SQLite's -wal and -shm beside it,
    whatever the umask; a store an older release left readable by all is made private."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        store = TurnStore(tmp_path / "turns.db")
        _record(store, "s", [USER], "x")
        files = [tmp_path / f for f in ("turns.db", "turns.db-wal", "turns.db-shm")]
        assert [stat.S_IMODE(os.stat(f).st_mode) for f in files] == [0o600] * 3
        store.close()  # SQLite removes its -wal and -shm files
        os.chmod(files[0], 0o644)
        TurnStore(tmp_path / "turns.db").close()
        assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_sigterm_while_a_batch_fills_hands_its_turns_back(tmp_path):
    """`ServeCallback.take` with a stop arriving after it took 1 of the 2 turns it waits for:
    it raises Lightning's SIGTERMException and the turn it took is `judged` again."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from composer_lightning.serve.training import ServeCallback

    store = TurnStore(tmp_path / "turns.db")
    (only,) = _judged(store, 1)
    trainer = SimpleNamespace(
        callbacks=[], _signal_connector=SimpleNamespace(received_sigterm=False)
    )

    def take_judged(limit, stale=None):  # the stop arrives once a turn is taken
        got = TurnStore.take_judged(store, limit, stale=stale)
        trainer._signal_connector.received_sigterm = True
        return got

    owner = SimpleNamespace(
        batch_size=2, poll_s=0.0, _stale=lambda version: None,
        store=SimpleNamespace(take_judged=take_judged, give_back=store.give_back),
    )  # fmt: skip
    with pytest.raises(SIGTERMException):
        ServeCallback.take(owner, trainer, version=0)
    assert store.get(only).state == "judged"

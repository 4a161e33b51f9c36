"""A durable store of served turns, from recording to training (SQLite, stdlib `sqlite3`).

A turn is one served assistant reply: its context (the request's chat messages and tools), the
prompt ids the chat template gave once on the server, the sampled response ids, text and
engine log-probs, and the weight version (and launch: `serve/lineage.py`) that sampled it. Its
life:

    recorded ──(next request of the session shows what followed it)──> ready
    recorded ──(session ended, or no next request within the timeout)──> ready (empty next state)
    ready ──claim──> judging ──set_judged──> judged ──take_judged──> taken
    taken ──a checkpoint holding the step that took it is written──> trained
    judged ──take_judged on weights too many steps back──> dropped ("stale")

A turn is `trained` only once a checkpoint holds the training step that took it
(`confirm_trained`); at every start, turns that no restored checkpoint holds go back to `judged`
(`untrain`), so a crash before any checkpoint loses none and a turn is trained exactly once.

The file (and SQLite's -wal and -shm beside it) is readable by its owner only (0600): it holds
what clients said. Every write is one transaction in WAL mode with `synchronous=FULL`, so a turn
whose `record` returned survives a kill -9 or a power cut. A judge claims turns under a name; a claim that its
owner never finished is taken back by the same name (`reclaim`, when a judge restarts) or by
anyone once its lease has passed, and `set_judged` only lands for the current claimant of a `judging` turn:
a judged turn is never judged again.

Simplified: one connection behind a lock (SQLite serialises writers anyway); several processes
may share the file (`BEGIN IMMEDIATE` and a busy timeout order them).

Why this file is long: it is the only code that writes the turns table. Each state change above
is one method and one transaction, and the rules that make judging exactly-once and a resume's
hand-back exact (claims, leases, retries, staleness) hold only read together.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

State = Literal["recorded", "ready", "judging", "judged", "taken", "trained", "dropped"]
STATES: tuple[State, ...] = (
    "recorded", "ready", "judging", "judged", "taken", "trained", "dropped"
)  # fmt: skip

_SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,
    prompt_ids TEXT NOT NULL,
    response_ids TEXT NOT NULL,
    response_text TEXT NOT NULL,
    logprobs TEXT NOT NULL,
    version INTEGER NOT NULL,
    created REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'recorded',
    next_state TEXT,
    ready_reason TEXT,
    claimant TEXT,
    claimed_at REAL,
    reward REAL,
    hint TEXT,
    drop_reason TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    retry_at REAL,
    UNIQUE (session, turn_index)
);
CREATE INDEX IF NOT EXISTS turns_state ON turns (state, id);
CREATE INDEX IF NOT EXISTS turns_session ON turns (session, turn_index);
CREATE TABLE IF NOT EXISTS launches (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER,
    start_version INTEGER NOT NULL,
    created REAL NOT NULL
);
"""

_JSON_FIELDS = ("messages", "tools", "prompt_ids", "response_ids", "logprobs", "next_state")


@dataclass(frozen=True)
class Turn:
    """One served turn as stored.

    Attributes:
        id: the store's id of the turn. session: the session id. turn_index: 0, 1, ... within it.
        messages: the request's chat messages (the turn's context). tools: its tool specs.
        prompt_ids: the chat template of `messages` (and `tools`) with the generation prompt.
        response_ids, response_text, logprobs: the sampled reply and its engine log-probs.
        version: the weight version that sampled it. created: when it was recorded (epoch s).
        launch: the start of the run whose weights sampled it (`begin_launch`; 0: a turn
            recorded before launches were, or outside a run); see `serve/lineage.py`.
        state: where it is in its life (module docstring).
        next_state: the messages that followed the reply in the session's next request; [] when
            the session ended or timed out first; None while unknown.
        ready_reason: "next", "session_done" or "timeout" once the next state is known.
        claimant: who is judging it (or judged it). reward, hint: the judge's verdict.
        drop_reason: why it was dropped ("stale", "judge_failed", or a judge's reason).
        attempts: judge calls that failed on it (`release`).
        group_id, choice: the choices of one request with `n` > 1 form a group (`group`: the
            id of its choice 0; None for choice 0 itself) trained together (`take_judged`).
    """

    id: int
    session: str
    turn_index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str
    logprobs: list[float]
    version: int
    created: float
    state: State
    next_state: list[dict[str, Any]] | None
    ready_reason: str | None
    claimant: str | None
    reward: float | None
    hint: str | None
    drop_reason: str | None
    attempts: int = 0
    launch: int = 0
    group_id: int | None = None
    choice: int = 0

    @property
    def group(self) -> int:
        """The id shared by the choices of one request (`n` > 1): the first choice's id."""
        return self.id if self.group_id is None else self.group_id


#: columns added after the first stores were written: (name, definition), added on open
_ADDED_COLUMNS = (
    ("attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("retry_at", "REAL"),
    ("launch", "INTEGER NOT NULL DEFAULT 0"),
    ("group_id", "INTEGER"),
    ("choice", "INTEGER NOT NULL DEFAULT 0"),
)


def _private(path: str) -> None:
    """Make the store's file readable by its owner only (0600), before SQLite opens it: it
    holds what clients said. SQLite gives its -wal and -shm files the database's mode."""
    if path == ":memory:" or path.startswith("file:"):
        return
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    if os.stat(path).st_mode & 0o077:  # a store an older release made readable by all
        os.chmod(path, 0o600)
        for side in (f"{path}-wal", f"{path}-shm"):
            if os.path.exists(side):
                os.chmod(side, 0o600)


def _turn(row: sqlite3.Row) -> Turn:
    data = {k: row[k] for k in row.keys() if k not in ("claimed_at", "retry_at")}
    for k in _JSON_FIELDS:
        data[k] = None if data[k] is None else json.loads(data[k])
    return Turn(**data)


class TurnStore:
    """Served turns in one SQLite file (module docstring).

    Args:
        path: the database file; created with its tables when missing.
        busy_timeout_s: how long a write waits for another process's transaction.
    """

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)
        _private(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        self._db.row_factory = sqlite3.Row
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"TurnStore: {self.path!r} refused WAL mode (got {mode!r})")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._write() as db:
            # executescript would commit on its own; one statement at a time stays in BEGIN.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            have = {r[1] for r in db.execute("PRAGMA table_info(turns)")}
            for name, definition in _ADDED_COLUMNS:  # a store written by an older version
                if name not in have:
                    db.execute(f"ALTER TABLE turns ADD COLUMN {name} {definition}")

    def close(self) -> None:
        """Close the connection (every committed write is already on disk)."""
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def record(
        self,
        session: str,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        response_ids: list[int],
        response_text: str,
        logprobs: list[float],
        version: int,
        tools: list[dict[str, Any]] | None = None,
        drop_reason: str | None = None,
        launch: int = 0,
    ) -> int:
        """Store a served turn as the session's next one; returns its id once it is on disk.

        `drop_reason`: the turn is recorded as dropped for this reason, in the same transaction
        (a turn that must not be trained on is never, even for an instant, trainable)."""
        (turn_id,) = self.record_choices(
            session, messages, prompt_ids, [(response_ids, response_text, logprobs)], version,
            tools, drop_reason, launch,
        )  # fmt: skip
        return turn_id

    def record_choices(
        self,
        session: str,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        choices: list[tuple[list[int], str, list[float]]],
        version: int,
        tools: list[dict[str, Any]] | None = None,
        drop_reason: str | None = None,
        launch: int = 0,
    ) -> list[int]:
        """Store the n choices of one request (`(response_ids, text, logprobs)` each) as the
        session's next turns, one group (`Turn.group`), in one transaction; their ids."""
        for ids, _, logprobs in choices:
            if len(logprobs) != len(ids):
                raise ValueError(
                    f"record: {len(logprobs)} log-probs for {len(ids)} response tokens"
                )
        with self._write() as db:
            (last,) = db.execute(
                "SELECT MAX(turn_index) FROM turns WHERE session = ?", (session,)
            ).fetchone()
            first = 0 if last is None else last + 1
            out: list[int] = []
            for j, (response_ids, response_text, logprobs) in enumerate(choices):
                cur = db.execute(
                    "INSERT INTO turns (session, turn_index, messages, tools, prompt_ids, "
                    "response_ids, response_text, logprobs, version, created, state, "
                    "drop_reason, launch, group_id, choice) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        session,
                        first + j,
                        json.dumps(messages),
                        None if tools is None else json.dumps(tools),
                        json.dumps([int(t) for t in prompt_ids]),
                        json.dumps([int(t) for t in response_ids]),
                        response_text,
                        json.dumps([float(x) for x in logprobs]),
                        int(version),
                        time.time(),
                        "recorded" if drop_reason is None else "dropped",
                        drop_reason,
                        int(launch),
                        out[0] if out else None,
                        j,
                    ),
                )
                assert cur.lastrowid is not None  # set by the INSERT
                out.append(int(cur.lastrowid))
            return out

    def begin_launch(self, parent: int | None, start_version: int) -> int:
        """Record a start of the run, from weight version `start_version`, resumed from a
        checkpoint of launch `parent` (None: a fresh start); returns its id, never reused."""
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO launches (parent, start_version, created) VALUES (?, ?, ?)",
                (None if parent is None else int(parent), int(start_version), time.time()),
            )
            assert cur.lastrowid is not None  # set by the INSERT
            return int(cur.lastrowid)

    def launches(self) -> dict[int, tuple[int | None, int]]:
        """Every launch: id -> (parent launch or None, start version) (`serve/lineage.py`)."""
        rows = self._read("SELECT id, parent, start_version FROM launches")
        return {int(r[0]): (None if r[1] is None else int(r[1]), int(r[2])) for r in rows}

    def attach_next_state(
        self, session: str, messages: list[dict[str, Any]], fmt: str = "auto"
    ) -> int | None:
        """Give the session's latest `recorded` turn that `messages` continues its next state.

        A turn whose context had k messages is continued by `messages` when `messages[:k]` is
        that context (same roles and texts) and `messages[k]` an assistant message with the
        turn's reply (its text, or its tool calls in OpenAI's form: `chat.tool_calls.same_reply`);
        its next state is `messages[k + 1:]`. Calls in text are read in format `fmt`.

        Returns:
            The id of the turn that became `ready`, or None when no recorded turn matches (a
            new session, or a client that edited or regenerated the reply: that turn waits for
            `end_session` or `expire`).
        """
        # here, not at the top: this file runs on the standard library alone (tests load it
        # by path in processes without the package's heavy imports)
        from composer_lightning.chat.tool_calls import same_messages, same_reply

        with self._write() as db:
            rows = db.execute(
                "SELECT id, messages, response_text, group_id FROM turns "
                "WHERE session = ? AND state = 'recorded' ORDER BY turn_index DESC",
                (session,),
            ).fetchall()
            for row in rows:
                context = json.loads(row["messages"])
                k = len(context)
                if k >= len(messages) or not same_messages(context, messages[:k]):
                    continue
                reply = messages[k]
                if reply.get("role") != "assistant" or not same_reply(
                    reply, row["response_text"], fmt
                ):
                    continue
                db.execute(
                    "UPDATE turns SET state = 'ready', next_state = ?, ready_reason = 'next' "
                    "WHERE id = ?",
                    (json.dumps(messages[k + 1 :]), row["id"]),
                )
                # the request's other choices: the client went on with this one
                group = row["id"] if row["group_id"] is None else row["group_id"]
                db.execute(
                    "UPDATE turns SET state = 'ready', next_state = '[]', "
                    "ready_reason = 'not_continued' WHERE state = 'recorded' "
                    "AND (id = ? OR group_id = ?)",
                    (group, group),
                )
                return int(row["id"])
            return None

    def end_session(self, session: str, reason: str = "session_done") -> int:
        """Make the session's `recorded` turns `ready` with an empty next state; returns how many."""
        with self._write() as db:
            return db.execute(
                "UPDATE turns SET state = 'ready', next_state = '[]', ready_reason = ? "
                "WHERE session = ? AND state = 'recorded'",
                (reason, session),
            ).rowcount

    def expire(self, older_than_s: float) -> int:
        """Make `recorded` turns served more than `older_than_s` ago `ready` with an empty next
        state (their session went quiet); returns how many."""
        if not older_than_s >= 0:
            raise ValueError(f"expire: older_than_s must be >= 0 seconds, got {older_than_s!r}")
        with self._write() as db:
            return db.execute(
                "UPDATE turns SET state = 'ready', next_state = '[]', ready_reason = 'timeout' "
                "WHERE state = 'recorded' AND created < ?",
                (time.time() - older_than_s,),
            ).rowcount

    def claim_ready(self, limit: int, *, claimant: str, lease_s: float = 600.0) -> list[Turn]:
        """Claim up to `limit` turns to judge, oldest first, in one transaction.

        Claimable: `ready` turns (once a failed judge call's backoff has passed, `release`), and
        `judging` turns whose claim is older than `lease_s` (their judge died). A judge restarted under the same name takes its own unfinished claims back
        at once with `reclaim`.

        Returns:
            The claimed turns, now `judging` under `claimant`.
        """
        if limit < 1:
            raise ValueError(f"claim_ready: limit must be >= 1, got {limit!r}")
        now = time.time()
        return self._claim(
            "(state = 'ready' AND (retry_at IS NULL OR retry_at <= ?)) "
            "OR (state = 'judging' AND claimed_at < ?) ORDER BY id LIMIT ?",
            (now, now - lease_s, limit),
            claimant,
            now,
        )

    def reclaim(self, claimant: str) -> list[Turn]:
        """The turns `claimant` claimed and never judged (call it once when a judge restarts),
        with their lease renewed."""
        return self._claim(
            "state = 'judging' AND claimant = ? ORDER BY id", (claimant,), claimant, time.time()
        )

    def _claim(self, where: str, args: tuple[Any, ...], claimant: str, now: float) -> list[Turn]:
        if not claimant:
            raise ValueError("a claimant must be a non-empty name, got an empty one")
        with self._write() as db:
            ids = [r[0] for r in db.execute(f"SELECT id FROM turns WHERE {where}", args)]
            db.executemany(
                "UPDATE turns SET state = 'judging', claimant = ?, claimed_at = ? WHERE id = ?",
                [(claimant, now, i) for i in ids],
            )
            return self._turns(db, ids)

    def release(self, turn_id: int, *, claimant: str, retry_after_s: float) -> int | None:
        """Give back a turn whose judge call failed (an outage, not a verdict): `ready` again,
        claimable once `retry_after_s` have passed, its `attempts` counted.

        Returns:
            The turn's failed attempts so far, or None when `claimant` was not judging it.
        """
        with self._write() as db:
            done = db.execute(
                "UPDATE turns SET state = 'ready', claimant = NULL, attempts = attempts + 1, "
                "retry_at = ? WHERE id = ? AND state = 'judging' AND claimant = ?",
                (time.time() + retry_after_s, turn_id, claimant),
            ).rowcount
            if not done:
                return None
            return int(
                db.execute("SELECT attempts FROM turns WHERE id = ?", (turn_id,)).fetchone()[0]
            )

    def set_judged(
        self, turn_id: int, reward: float | None, hint: str | None, *, claimant: str
    ) -> bool:
        """Store the verdict on a turn `claimant` is judging.

        Returns:
            True when it landed; False when the turn is not `judging` under `claimant` (judged
            already, or claimed by another judge after the lease passed): the verdict is dropped.
        """
        with self._write() as db:
            return (
                db.execute(
                    "UPDATE turns SET state = 'judged', reward = ?, hint = ? "
                    "WHERE id = ? AND state = 'judging' AND claimant = ?",
                    (None if reward is None else float(reward), hint, turn_id, claimant),
                ).rowcount
                == 1
            )

    def drop(self, turn_id: int, reason: str, *, claimant: str | None = None) -> bool:
        """Drop a turn that is not trained yet (a judge that cannot judge it; `claimant`: only
        while it holds the claim). Returns whether it was dropped."""
        sql = (
            "UPDATE turns SET state = 'dropped', drop_reason = ? WHERE id = ? "
            "AND state NOT IN ('taken', 'trained')"
        )
        args: tuple[Any, ...] = (reason, turn_id)
        if claimant is not None:
            sql += " AND state = 'judging' AND claimant = ?"
            args += (claimant,)
        with self._write() as db:
            return db.execute(sql, args).rowcount == 1

    def take_judged(
        self,
        limit: int,
        min_version: int | None = None,
        stale: Callable[[int, int], bool] | None = None,
    ) -> list[Turn]:
        """Hand up to `limit` judged turns to a training step, oldest first, marking them
        `taken` (`trained` once a checkpoint holds the step: `confirm_trained`).

        The choices of one request (a group) go together, once none of them waits for its
        judge (members dropped meanwhile are left out); a group is never split, and one larger
        than `limit` is handed over alone.

        Args:
            limit: the most turns returned (≥ 1).
            min_version: judged turns sampled by an older weight version are dropped as "stale"
                first (all of them, counted in `counts()["dropped/stale"]`).
            stale: `stale(launch, version)`: whether a judged turn of that launch and version
                is too old to train on; such turns are dropped as "stale" first, all of them,
                in the same transaction.
        """
        if limit < 1:
            raise ValueError(f"take_judged: limit must be >= 1, got {limit!r}")
        with self._write() as db:
            if min_version is not None:
                db.execute(
                    "UPDATE turns SET state = 'dropped', drop_reason = 'stale' "
                    "WHERE state = 'judged' AND version < ?",
                    (int(min_version),),
                )
            if stale is not None:
                rows = db.execute("SELECT id, launch, version FROM turns WHERE state = 'judged'")
                old = [(r[0],) for r in rows if stale(int(r[1]), int(r[2]))]
                db.executemany(
                    "UPDATE turns SET state = 'dropped', drop_reason = 'stale' WHERE id = ?", old
                )
            ids = self._whole_groups(db, limit)
            db.executemany("UPDATE turns SET state = 'taken' WHERE id = ?", [(i,) for i in ids])
            return self._turns(db, ids)

    def confirm_trained(self, held: list[int]) -> int:
        """Mark the `taken` turns among `held` `trained`: call it once a checkpoint holding the
        steps that took them is written. Returns how many."""
        with self._write() as db:
            taken = {int(r[0]) for r in db.execute("SELECT id FROM turns WHERE state = 'taken'")}
            now = sorted(taken & {int(i) for i in held})
            db.executemany("UPDATE turns SET state = 'trained' WHERE id = ?", [(i,) for i in now])
            return len(now)

    def give_back(self, ids: list[int]) -> int:
        """Hand the `taken` turns among `ids` back to training (`judged`): a step that took
        them stopped before it trained (a stop while its batch was still filling). Returns
        how many."""
        with self._write() as db:
            return sum(
                db.execute(
                    "UPDATE turns SET state = 'judged' WHERE id = ? AND state = 'taken'", (int(i),)
                ).rowcount
                for i in ids
            )

    def untrain(self, keep: list[int] | None) -> int:
        """Hand back to training (`judged`) the turns taken by steps that the weights a run
        starts from do not hold; call it at every start.

        Args:
            keep: the turns the restored checkpoint's steps took (they are `trained`: that
                checkpoint exists), every other `taken` or `trained` turn goes back; None (no
                checkpoint restored): the `taken` turns go back, the `trained` ones (which
                some checkpoint holds) stay.

        Returns:
            How many went back.
        """
        with self._write() as db:
            if keep is None:
                return db.execute(
                    "UPDATE turns SET state = 'judged' WHERE state = 'taken'"
                ).rowcount
            kept = {int(i) for i in keep}
            rows = db.execute("SELECT id FROM turns WHERE state IN ('taken', 'trained')")
            ids = [int(r[0]) for r in rows]
            db.executemany(
                "UPDATE turns SET state = ? WHERE id = ?",
                [("trained" if i in kept else "judged", i) for i in ids],
            )
            return sum(i not in kept for i in ids)

    def get(self, turn_id: int) -> Turn:
        """One turn by id (KeyError naming it when there is none)."""
        rows = self._read("SELECT * FROM turns WHERE id = ?", (turn_id,))
        if not rows:
            raise KeyError(f"TurnStore: no turn with id {turn_id!r} in {self.path!r}")
        return _turn(rows[0])

    def session_turns(self, session: str) -> list[Turn]:
        """The session's turns in order."""
        rows = self._read("SELECT * FROM turns WHERE session = ? ORDER BY turn_index", (session,))
        return [_turn(r) for r in rows]

    def counts(self) -> dict[str, int]:
        """Turns per state (every state, 0 included), "dropped/<reason>" per drop reason, and
        "sessions" (distinct session ids): for metrics."""
        out: dict[str, int] = dict.fromkeys(STATES, 0)
        for row in self._read("SELECT state, COUNT(*) FROM turns GROUP BY state"):
            out[row[0]] = row[1]
        for row in self._read(
            "SELECT drop_reason, COUNT(*) FROM turns WHERE state = 'dropped' GROUP BY drop_reason"
        ):
            out[f"dropped/{row[0]}"] = row[1]
        out["sessions"] = self._read("SELECT COUNT(DISTINCT session) FROM turns")[0][0]
        return out

    @staticmethod
    def _whole_groups(db: sqlite3.Connection, limit: int) -> list[int]:
        """Ids of the oldest judged turns, whole groups only, at most `limit` (or one group)."""
        rows = db.execute(
            "SELECT id, COALESCE(group_id, id) AS g FROM turns WHERE state = 'judged' ORDER BY id"
        ).fetchall()
        waiting = {
            int(r[0])
            for r in db.execute(
                "SELECT DISTINCT COALESCE(group_id, id) FROM turns "
                "WHERE state IN ('recorded', 'ready', 'judging')"
            )
        }
        groups: dict[int, list[int]] = {}
        for r in rows:
            if int(r[1]) not in waiting:
                groups.setdefault(int(r[1]), []).append(int(r[0]))
        ids: list[int] = []
        for members in groups.values():
            if ids and len(ids) + len(members) > limit:
                break
            ids += members
            if len(ids) >= limit:
                break
        return ids

    @staticmethod
    def _turns(db: sqlite3.Connection, ids: list[int]) -> list[Turn]:
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        rows = db.execute(f"SELECT * FROM turns WHERE id IN ({marks}) ORDER BY id", ids)
        return [_turn(r) for r in rows]

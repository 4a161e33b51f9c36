"""Training from served conversations: `ServeCallback` (`serve` mode; its step indices come from
`ServeDataModule`, data.py).

    python -m composer_lightning serve --config configs/serve_cpu.yaml

The callback starts the policy's engine behind an OpenAI-compatible endpoint (`app.py`, on
127.0.0.1 by default) and records every turn it serves (`store.py`). A judge thread judges each
recorded turn once its next state is known (the session's next request, its end, or a
timeout): the turn goes to the score and hint providers as an episode's turn does —
`(context, turn, next state)`, `rollout/turns.py`, `turn_problem` — and the verdict (a score and/or a
hint) is stored; a turn with neither is dropped (the fourth dispatch path). Each optimizer step
takes `batch_size` judged turns, oldest first: one sample each (G = 1, OpenClaw-RL's reward
broadcast: no group baseline; the n choices of one request with n > 1 go together as one group,
their mean reward its baseline), its hinted teacher context built as for any turn, and each with
its own weight version — turns more than `max_staleness` optimizer steps from the trained
weights are dropped (counted; across restarts the steps are counted through the version tree,
`lineage.py`), the rest are importance-corrected per token against their engine log-probs
(`importance_cap`).
After the step the weights are pushed into the engine between two generations, never inside
one: serving never waits for training, only for the one generation in flight.

A turn is trained on only if it was sampled as training samples are — at `sampling.temperature`
with top_p = 1 and no top_k (the trainer's log-probs are those of that distribution); other
requests (greedy evaluation, another temperature) are served and recorded but not trained on
(dropped, "sampling"). The store is durable: after a crash (kill -9) and a restart every
recorded turn is still there, a turn is judged once, and a turn is `trained` in the store only
once a checkpoint holds the step that took it: at every start (a crash before the first
checkpoint included) turns taken by steps that no restored checkpoint holds go back to
training; the turns the lost weights served keep their
own place in the version tree (a resumed run's version numbers say nothing about them).

Why this file is long: `ServeCallback` is the class a `serve` run configures as `rollout:`, and
its options are documented on it (what `--help` shows); the order of its start (restore, push,
hand-back, launch, serve, judge) and of its stop only holds read together.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any, Literal, cast

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from composer_lightning.chat.hints import HINT_TEMPLATE, fill_hint
from composer_lightning.chat.tool_calls import check_format
from composer_lightning.engines.base import (
    Completion,
    EngineContext,
    RolloutEngine,
    SamplingConfig,
    StepEngine,
)
from composer_lightning.engines.fingerprint import FingerprintRecorder
from composer_lightning.models.weights import iter_hf_weights
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.rollout.dispatch import dispatch
from composer_lightning.rollout.packing import pack_samples
from composer_lightning.rollout.providers import provider_values
from composer_lightning.rollout.turns import rollout_sample
from composer_lightning.runtime.distributed import StepMetrics
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.runtime.moved import moved_attribute
from composer_lightning.runtime.rundir import run_dir
from composer_lightning.serve.lineage import distance
from composer_lightning.serve.store import TurnStore
from composer_lightning.tasks.base import HintProvider, ScoreProvider
from composer_lightning.training.canary import check_fingerprint

log = logging.getLogger(__name__)

JUDGE = "judge"  # the store's claimant name of this process's judge thread


class ServeCallback(RolloutCallback):
    """Serve the policy over HTTP and train on the judged turns of its conversations.

    Args:
        engine: the policy's engine (started in `setup`; serves every request).
        store: the SQLite file of served turns (created, with its directory, if missing; kept
            across restarts). None: `turns.sqlite` beside the run's versions, in the logger's
            `<save_dir>/<name>` (else `trainer.default_root_dir`), which a restart shares.
        batch_size: B, judged turns per optimizer step.
        sampling: the training sampling (temperature, max_tokens default of a request);
            a request that asks for nothing else samples with it and is trained on.
        score: the per-turn score provider (e.g. `NextStateJudgeScore`, the m-vote PRM).
        hint: the per-turn hint provider (e.g. `NextStateJudgeHint`); None: no teacher.
        hint_role: role of the message that carries the hint.
        hint_template: the hint's text as the teacher reads it, with `{hint}` where the judge's
            hint goes (`rollout.hint_template`; "{hint}": the hint itself).
        max_staleness: judged turns sampled more than this many versions ago are dropped.
        host, port: where to listen (127.0.0.1; port 0: a free one, printed at start).
        api_key: the bearer token clients must send, or one per client (sessions are owned
            per key: no key reaches another's; rate limits are per key); None: none, one tenant
            (every client may continue, score or end any session; said at start), bound to
            127.0.0.1 by default (`serve/access.py`).
        model_name: the model id served at `/v1/models`.
        max_request_bytes, rate_limit_per_minute: request limits (413, 429).
        session_timeout_s: a turn whose session sends nothing more for this long is judged
            without a next state.
        poll_s: how often the judge thread and a waiting step look at the store.
        judge_attempts: judge calls a turn gets when they fail (a provider that raises, or
            counts failures): it is given back and tried again after `judge_backoff_s`, doubling
            each time; after the last it is dropped ("judge_failed", counted) unless part of a
            verdict came back.
        tool_call_format: the format of the policy's tool calls (`chat.tool_calls`):
            "template" (the chat template's), "auto", "hermes", "mistral" or "llama3_json".
    """

    def __init__(
        self,
        engine: RolloutEngine,
        store: str | None = None,
        batch_size: int = 8,
        sampling: SamplingConfig | None = None,
        score: ScoreProvider | None = None,
        hint: HintProvider | None = None,
        hint_role: str = "user",
        hint_template: str = HINT_TEMPLATE,
        max_staleness: int = 4,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | list[str] | None = None,
        model_name: str = "policy",
        max_request_bytes: int = 4 * 2**20,
        rate_limit_per_minute: int | None = None,
        session_timeout_s: float | None = 300.0,
        poll_s: float = 0.05,
        judge_attempts: int = 5,
        judge_backoff_s: float = 2.0,
        tool_call_format: str = "template",
    ):
        if score is None:
            raise ValueError("ServeCallback needs a per-turn score provider (rollout.score)")
        super().__init__(
            engine,
            1,
            sampling,
            score,
            hint,
            cast(Literal["user", "system", "inline"], hint_role),  # checked in setup
            samples_every_n_steps=0,
            val_samples=1,
            hint_template=hint_template,
        )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if (
            isinstance(max_staleness, bool)
            or not isinstance(max_staleness, int)
            or max_staleness < 0
        ):
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        self.store_path, self.batch_size, self.stale_limit = store, batch_size, max_staleness
        self.host, self.port, self.api_key, self.model_name = host, port, api_key, model_name
        self.max_request_bytes, self.rate_limit = max_request_bytes, rate_limit_per_minute
        self.session_timeout_s, self.poll_s = session_timeout_s, poll_s
        self.tool_call_format = check_format(tool_call_format, "ServeCallback")
        if (
            isinstance(judge_attempts, bool)
            or not isinstance(judge_attempts, int)
            or judge_attempts < 1
        ):
            raise ValueError(f"judge_attempts must be an integer >= 1, got {judge_attempts!r}")
        if not judge_backoff_s >= 0:
            raise ValueError(f"judge_backoff_s must be >= 0 seconds, got {judge_backoff_s!r}")
        self.judge_attempts, self.judge_backoff_s = judge_attempts, float(judge_backoff_s)
        # TurnStore, BackgroundServer, its backend and app: from setup to teardown, else None
        self.store: Any = None
        self.server: Any = None
        self.backend: Any = None
        self.app: Any = None
        self._store_file = ""
        self.url: str | None = None
        self._judge: threading.Thread | None = None
        self._stop = threading.Event()
        self._trained: list[int] = []  # turn ids taken by the steps done (what a checkpoint holds)
        self._restored_trained: list[int] | None = None
        self._launch = 0  # this start of the run (`TurnStore.begin_launch`)
        self._fingerprint_params = 0  # parameters the last push's fingerprint compared
        self._parent_launch: int | None = None  # the launch whose checkpoint was restored
        self._dropped_seen = 0  # the store's no-signal drops at the last step (or the start)

    # ------------------------------------------------------------------ start and stop
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Start the engine and open the store. Serving waits for `on_train_start`: Lightning
        restores a checkpoint (the weights, and this callback's `load_state_dict`) after
        `setup`, so only then are the turns a lost step took known, and the weights to serve
        pushed."""
        from composer_lightning.serve.backend import EngineBackend, StepBackend

        if trainer.world_size > 1:
            raise ConfigError(
                f"serve runs one process (one engine behind one endpoint); got {trainer.world_size}"
            )
        super().setup(trainer, pl_module, stage)  # temperature, engine start
        tokenizer = trainer.datamodule.tokenizer  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        # vLLM schedules continuously and streams; other engines share calls (`backend.py`)
        kind = StepBackend if isinstance(self.engine, StepEngine) else EngineBackend
        self.backend = kind(self.engine, tokenizer, context=EngineContext.current())
        self._store_file = store_file(trainer, self.store_path)
        self.store = TurnStore(self._store_file)
        self._confirm_on_save(trainer.strategy)

    def _confirm_on_save(self, strategy: Any) -> None:
        """After each checkpoint is written (ModelCheckpoint's, the stop's `last.ckpt`), mark
        the turns it holds `trained` in the store (`TurnStore.confirm_trained`): a turn is
        trained once a checkpoint holding its step exists, and a write that fails confirms
        nothing. (Lightning has no hook after a write: the strategy's save is wrapped, as
        `runtime/checkpoint_io.atomic_saves` wraps it.)"""
        save = strategy.save_checkpoint
        if getattr(save, "confirms", None) is self:
            return

        @functools.wraps(save)
        def save_checkpoint(
            checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
        ) -> None:
            save(checkpoint, filepath, storage_options)
            state = (checkpoint.get("callbacks") or {}).get(self.state_key)
            if state is None:
                return
            # the stop's save may come after this callback closed its store (on_exception)
            store = self.store or TurnStore(self._store_file)
            store.confirm_trained(state.get("trained", []))
            if store is not self.store:
                store.close()

        save_checkpoint.confirms = self  # type: ignore[attr-defined]
        strategy.save_checkpoint = save_checkpoint

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the restore: push the (restored) weights, hand back the turns of steps no
        checkpoint holds, then serve and judge."""
        from composer_lightning.serve.access import SINGLE_TENANT_NOTICE
        from composer_lightning.serve.app import make_app
        from composer_lightning.serve.server import BackgroundServer

        super().on_train_start(trainer, pl_module)  # the push: replies come from these weights
        self._launch = self.store.begin_launch(self._parent_launch, pl_module.policy_version)
        reclaimed = self.store.reclaim(JUDGE)  # claimed before a crash, never judged: now
        self._dropped_seen = self.store.counts().get("dropped/no signal", 0)
        # turns taken by steps that these weights do not hold go back: those after the restored
        # checkpoint, or, with none restored, every turn no checkpoint holds (a crash before one)
        back = self.store.untrain(keep=self._restored_trained)
        if back:
            log.warning("%d turns taken by steps no checkpoint holds go back to training", back)
        self.app = make_app(
            self.backend,
            self.store,
            model_name=self.model_name,
            api_key=self.api_key,
            max_request_bytes=self.max_request_bytes,
            rate_limit_per_minute=self.rate_limit,
            default_max_tokens=self.sampling.max_tokens,
            session_timeout_s=self.session_timeout_s,
            train_sampling=self.sampling,
            launch=self._launch,
            tool_call_format=self.tool_call_format,
        )
        self.server = BackgroundServer(self.app, host=self.host, port=self.port)
        self.url = self.server.start()
        if self.api_key is None:
            print(SINGLE_TENANT_NOTICE, flush=True)
        print(f"composer_lightning: serving {self.model_name!r} at {self.url}/v1", flush=True)
        self._stop.clear()
        self._judge = threading.Thread(
            target=self._judge_loop, args=(reclaimed,), name="composer-judge", daemon=True
        )
        self._judge.start()

    def _close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop()  # in-flight requests finish first
            self.server = None
        if self._judge is not None:
            self._judge.join(timeout=60)
            self._judge = None
        if self.store is not None:
            self.store.close()
            self.store = None
        close = getattr(self.backend, "close", None)
        if callable(close):  # a StepBackend's engine thread
            close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close()
        super().teardown(trainer, pl_module, stage)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    # ------------------------------------------------------------------ judging
    def _judge_loop(self, reclaimed: list[Any]) -> None:
        if reclaimed:
            self.judge(reclaimed)
        while not self._stop.is_set():
            try:
                turns = self.store.claim_ready(16, claimant=JUDGE)
            except Exception as exc:  # a store error must not kill the judge thread silently
                log.warning("judge: the store failed: %s: %s", type(exc).__name__, exc)
                turns = []
            if not turns:
                self._stop.wait(self.poll_s)
                continue
            self.judge(turns)

    def judge(self, turns: list[Any]) -> None:
        """Score and hint `turns` with their next states and store the verdicts (a turn with
        neither is dropped: no signal)."""
        problems = [
            {
                "messages": t.messages,
                "next_state": t.next_state or [],
                "tool_error": None,
                "turn": t.turn_index,
                "session": t.session,
                "turn_id": t.id,
            }
            for t in turns
        ]
        texts = [t.response_text for t in turns]
        ids = [t.response_ids for t in turns]
        scores, score_failed = provider_values(self.score, "score", problems, texts, ids)
        hints, hint_failed = (
            provider_values(self.hint, "hint", problems, texts)
            if self.hint is not None
            else ([None] * len(turns), 0)
        )
        for t, s, h in zip(turns, scores, hints, strict=True):
            h = h[0] if isinstance(h, list) else h
            # A provider that failed on some samples does not say which: a missing value in a
            # call with failures may be an outage, not a verdict, so the turn is tried again.
            suspect = (s is None and score_failed) or (h is None and hint_failed)
            if suspect and t.attempts + 1 < self.judge_attempts:
                backoff = self.judge_backoff_s * 2**t.attempts
                self.store.release(t.id, claimant=JUDGE, retry_after_s=backoff)
            elif s is None and h is None:
                reason = "judge_failed" if suspect else "no signal"
                self.store.drop(t.id, reason, claimant=JUDGE)
            else:
                self.store.set_judged(t.id, s, h, claimant=JUDGE)

    # ------------------------------------------------------------------ train
    def _push(self, pl_module: L.LightningModule) -> float:
        """Push the weights and check, exactly, that the engine holds them: its fingerprint
        read right after the load, before any request is served with them."""
        start = time.perf_counter()
        if self.backend is not None:
            version = cast(int, pl_module.policy_version)
            policy = cast(torch.nn.Module, pl_module.policy)
            weights = FingerprintRecorder.for_engine(iter_hf_weights(policy), self.engine)
            engine_print = self.backend.push(weights, version)
            self._fingerprint_params = check_fingerprint(weights.finish(), engine_print, version)
        return time.perf_counter() - start

    def _synced(self, pl_module: L.LightningModule) -> bool:
        return self.backend is not None and self.backend.weight_version == pl_module.policy_version

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        start = time.perf_counter()
        version = cast(int, pl_module.policy_version)
        turns = self.take(trainer, version)
        self._trained += [t.id for t in turns]
        tokenizer = trainer.datamodule.tokenizer  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        rollout = self.samples(turns, tokenizer, version)
        metrics = StepMetrics()
        counts = self.store.counts()
        _, paths = dispatch(
            [t.reward is not None for t in turns], [t.hint is not None for t in turns]
        )
        paths["dispatch/dropped"] = float(self.dropped_since_last_step(counts))
        metrics.update(paths, kind="sum")
        served = self.app.state.metrics
        metrics.update(
            {
                "serve/requests": float(served.requests),
                "serve/sessions": float(counts.get("sessions", 0)),
                "serve/turns_recorded": float(served.turns_recorded),
                "serve/turns_judged": float(
                    counts.get("judged", 0) + counts.get("taken", 0) + counts.get("trained", 0)
                ),
                "serve/queue": float(counts.get("judged", 0)),
                "serve/dropped_stale": float(counts.get("dropped/stale", 0)),
                "serve/dropped_judge_failed": float(counts.get("dropped/judge_failed", 0)),
                "serve/version_served": float(self.backend.weight_version),
            },
            kind="max",
        )
        metrics.max("serve/wait_time", time.perf_counter() - start)
        metrics.max("rollout/fingerprint_params", float(self._fingerprint_params))
        assert rollout.policy_version is not None  # stamped by `samples`
        metrics.max("rollout/staleness_max", float(version - rollout.policy_version))
        rewarded = [t.reward for t in turns if t.reward is not None]
        metrics.mean(
            "rollout/reward_mean", sum(rewarded) / len(rewarded) if rewarded else 0.0,
            weight=float(len(rewarded)),
        )  # fmt: skip
        rollout.metrics = metrics
        batch.rollout = rollout.to(pl_module.device)
        trainer.datamodule.consumed = int(batch.index) + 1  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__

    def dropped_since_last_step(self, counts: dict[str, int]) -> int:
        """Turns dropped for no signal since the previous step (the other dispatch paths are
        per step too; the store's count is since the store began)."""
        now = counts.get("dropped/no signal", 0)
        before, self._dropped_seen = self._dropped_seen, now
        return now - before

    def take(self, trainer: L.Trainer, version: int) -> list[Any]:
        """`batch_size` judged turns for a step at policy `version`, oldest first, waiting for
        them (serving all the while); turns sampled more than `max_staleness` optimizer steps
        away from these weights (`serve/lineage.py`: a turn the weights a crash lost served is
        never near) are dropped on the way ("stale")."""
        turns: list[Any] = []
        while len(turns) < self.batch_size:
            if _signalled(trainer):  # stop while waiting: the last whole step is saved
                self.store.give_back([t.id for t in turns])  # and this one never trains
                raise SIGTERMException()
            taken = self.store.take_judged(self.batch_size - len(turns), stale=self._stale(version))
            turns += taken
            if not taken:
                time.sleep(self.poll_s)
        return turns

    def _stale(self, version: int) -> Any:
        """`stale(launch, turn_version)` for `take_judged`: farther than `max_staleness`
        optimizer steps from this launch's weights at `version`."""
        launches, here = self.store.launches(), (self._launch, version)
        return lambda launch, v: distance(launches, here, (launch, v)) > self.stale_limit

    def distances(self, turns: list[Any], version: int) -> list[int]:
        """Each turn's optimizer steps from the weights of this launch at `version`."""
        launches, here = self.store.launches(), (self._launch, version)
        return [distance(launches, here, (t.launch, t.version)) for t in turns]

    def samples(self, turns: list[Any], tokenizer: Any, version: int) -> RolloutBatch:
        """The rollout batch of judged `turns` for a step at policy `version`: one sample each
        (a group of one: OpenClaw-RL's reward broadcast; the n choices of one request: one
        group, whose mean reward is their baseline), with its engine log-probs and, for a hinted turn, its teacher context.
        The batch is stamped `version` minus its farthest turn's distance: on policy only when
        every turn was sampled by these very weights, else importance-corrected row by row
        against the engine log-probs; the rows these weights sampled are marked
        (`on_policy_rows`), so the canary compares them even in a batch of mixed versions."""
        rows = []
        for t in turns:
            c = Completion(list(t.response_ids), list(t.logprobs), "stop")
            rows.append(
                rollout_sample(
                    tokenizer,
                    t.messages,
                    t.prompt_ids,
                    c,
                    fill_hint(self.hint_template, t.hint),
                    self.hint_role,
                    t.tools,
                )
            )
        rb = pack_samples(
            rows,
            rewards=[t.reward for t in turns],
            group_ids=_group_ids(turns),
            pad_id=tokenizer.pad_token_id or 0,
            max_response_length=self.sampling.max_tokens,
            engine_logprobs=[[0.0] * len(t.prompt_ids) + list(t.logprobs) for t in turns],
        )
        distances = self.distances(turns, version)
        rb.policy_version = version - max(distances)
        rb.on_policy_rows = torch.tensor([d == 0 for d in distances])  # the canary's rows
        return rb

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        return None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"trained": list(self._trained), "launch": self._launch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._trained = list(state_dict.get("trained", []))
        self._restored_trained = list(self._trained)
        self._parent_launch = state_dict.get("launch")  # None: a checkpoint of an older release


def _group_ids(turns: list[Any]) -> list[int]:
    """0, 1, ... per group of `turns` (the choices of one request share one; `Turn.group`)."""
    index: dict[int, int] = {}
    return [index.setdefault(t.group, len(index)) for t in turns]


def store_file(trainer: L.Trainer, store: str | None) -> str:
    """The store's path (`store`, or `turns.sqlite` in the run's parent directory), its
    directory made if missing."""
    if store is None:
        parent = os.path.dirname(run_dir(trainer)) if trainer.loggers else None
        store = os.path.join(parent or trainer.default_root_dir, "turns.sqlite")
    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    return store


def _signalled(trainer: L.Trainer) -> bool:
    """Whether a stop signal reached this process (`CheckpointOnStop`'s flag, or Lightning's)."""
    from composer_lightning.callbacks.stop import CheckpointOnStop

    for cb in trainer.callbacks:  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        if isinstance(cb, CheckpointOnStop) and cb._received:
            cb._signal = cb._received
            return True
    return bool(getattr(trainer._signal_connector, "received_sigterm", False))


def __getattr__(name: str) -> object:  # the names that moved to another file (runtime/moved.py)
    return moved_attribute(__name__, name)

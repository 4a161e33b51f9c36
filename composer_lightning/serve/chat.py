"""`POST /v1/chat/completions`: one request's path through the app, in order.

Authorise, limit, parse, render once with the policy's chat template, give the session's
previous turn its next state, generate (on the backend's engine thread, or a worker thread: the
event loop keeps serving) or stream, and record every choice as the session's next turns
(`TurnStore.record_choices`). A client that disconnects while its reply is generated gets
nothing recorded: a streaming backend stops its generation, another drops the reply once the
generation finishes. `serve/app.py` builds the app around it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from composer_lightning.chat import render_ids
from composer_lightning.chat.tool_calls import for_template
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.serve.access import Access, RateLimiter
from composer_lightning.serve.backend import ServeBackend
from composer_lightning.serve.protocol import (
    ApiError,
    ChatRequest,
    Choice,
    chunk_bodies,
    chunk_body,
    completion_body,
    end_chunks,
    new_id,
    streamable,
    usage_chunk,
    with_tool_calls,
)
from composer_lightning.serve.request import parse_request, read_json
from composer_lightning.serve.store import TurnStore


@dataclass
class ServeMetrics:
    """Counters of one app (read `app.state.metrics`).

    Attributes:
        requests: chat-completion requests received. turns_recorded: turns stored.
        disconnects: replies dropped because their client left. errors: answers by status ≥ 400.
    """

    requests: int = 0
    turns_recorded: int = 0
    disconnects: int = 0
    errors: Counter[int] = field(default_factory=Counter)

    def as_dict(self, store: TurnStore) -> dict[str, Any]:
        """The counters with the store's turns per state and its session count."""
        counts = store.counts()
        return {
            "requests": self.requests,
            "sessions": counts.pop("sessions"),
            "turns_recorded": self.turns_recorded,
            "disconnects": self.disconnects,
            **{f"errors/{s}": n for s, n in sorted(self.errors.items())},
            **{f"turns/{k}": v for k, v in counts.items()},
        }


def _cut_at_stop(tokenizer: Any, c: Completion, stops: list[str]) -> tuple[Completion, Choice]:
    """The completion up to the token that completes the first stop string, and the text shown
    (before the stop string); unchanged without stop strings or a match."""
    text = c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return c, Choice(text, c.finish_reason)
    for k in range(1, len(c.token_ids) + 1):
        prefix = tokenizer.decode(c.token_ids[:k], skip_special_tokens=True)
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            kept = Completion(c.token_ids[:k], c.logprobs[:k], "stop", prefix)
            return kept, Choice(prefix[: min(hits)], "stop")
    return c, Choice(text, c.finish_reason)  # only the engine's own text held the stop


@dataclass(frozen=True)
class ChatSettings:
    """One app's limits and defaults (`make_app`'s arguments of the same names).

    Attributes:
        model_name: the one model id served; requests must name it.
        max_request_bytes: larger bodies are refused with 413.
        max_n: the largest `n` accepted.
        default_max_tokens: reply length when a request gives none (cut to the context left).
        disconnect_poll_s: how often a generation checks whether its client is still there.
        train_sampling: the sampling training rollouts use (None: every turn is trainable).
        launch: the start of the run serving, recorded with each turn; 0: none.
        tool_call_format: the resolved format of tool calls (`chat.tool_calls`).
    """

    model_name: str
    max_request_bytes: int
    max_n: int
    default_max_tokens: int
    disconnect_poll_s: float
    train_sampling: SamplingConfig | None
    launch: int
    tool_call_format: Any

    @property
    def default_temperature(self) -> float:
        """A request's temperature when it names none: the training rollouts'."""
        return 1.0 if self.train_sampling is None else self.train_sampling.temperature


class ChatCompletions:
    """`POST /v1/chat/completions` over one app's backend, store, access and counters."""

    def __init__(
        self,
        backend: ServeBackend,
        store: TurnStore,
        settings: ChatSettings,
        access: Access,
        limiter: RateLimiter | None,
        metrics: ServeMetrics,
    ):
        self.backend, self.store, self.settings = backend, store, settings
        self.access, self.limiter, self.metrics = access, limiter, metrics

    async def complete(self, request: Request) -> Response:
        """Answer one request (streamed or not) and record its turns."""
        backend, store, metrics = self.backend, self.store, self.metrics
        settings, fmt, launch = self.settings, self.settings.tool_call_format, self.settings.launch
        metrics.requests += 1
        caller = self.access.caller(request)
        if self.limiter is not None and not self.limiter.allow(caller.bucket):
            raise ApiError(
                429, f"Rate limit reached: {self.limiter.per_minute} requests per minute.",
                type="requests", code="rate_limit_exceeded",
            )  # fmt: skip
        body = await read_json(request, settings.max_request_bytes)
        req = parse_request(body, dict(request.headers), max_n=settings.max_n)
        # from here on the session is named as the store keeps it: within the caller's own
        req = dataclasses.replace(req, session=caller.session(req.session))
        check_model(req.model, settings.model_name)
        # the history's OpenAI tool calls as this template renders them; stored in this form
        # (tools a template does not render are described in the system message by render_ids)
        req = dataclasses.replace(req, messages=for_template(req.messages, backend.tokenizer, fmt))
        prompt_ids = _render(backend.tokenizer, req)
        sampling = _sampling(
            req,
            len(prompt_ids),
            backend.max_context,
            settings.default_max_tokens,
            settings.default_temperature,
        )
        if not req.side:
            await run_in_threadpool(store.attach_next_state, req.session, req.messages, fmt)
        opened = getattr(backend, "open", None)  # a backend that streams (`StepBackend`)
        if callable(opened):
            stream = opened(prompt_ids, req.n, sampling)
            if req.stream:
                events = self.streamed(stream, req, prompt_ids, sampling)
                return StreamingResponse(events, media_type="text/event-stream")
            generation = asyncio.ensure_future(_finished(stream))
        else:
            stream = None
            generation = asyncio.ensure_future(
                run_in_threadpool(backend.generate, prompt_ids, req.n, sampling)
            )
        while not (await asyncio.wait({generation}, timeout=settings.disconnect_poll_s))[0]:
            if await request.is_disconnected():
                metrics.disconnects += 1
                if stream is not None:
                    backend.cancel(stream)  # type: ignore[attr-defined]
                generation.add_done_callback(lambda t: t.cancelled() or t.exception())
                return Response(status_code=499)  # nobody reads it
        completions, version = generation.result()
        served, usage = await self.finish(req, prompt_ids, sampling, completions, version)
        cid = new_id()
        if not req.stream:
            return JSONResponse(completion_body(req, cid, served, usage, version, launch))
        chunks = chunk_bodies(req, cid, served, usage, version, launch)
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    async def finish(
        self,
        req: ChatRequest,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        completions: list[Completion],
        version: int,
    ) -> tuple[list[Choice], dict[str, int]]:
        """A generated reply as served (stop strings, tool calls) and its usage; the turn
        recorded (a main turn) and the session ended when the request says so."""
        backend, store, fmt = self.backend, self.store, self.settings.tool_call_format
        train_sampling, launch = self.settings.train_sampling, self.settings.launch
        kept, choices = zip(
            *(_cut_at_stop(backend.tokenizer, c, req.stop) for c in completions), strict=True
        )
        served = [with_tool_calls(c, bool(req.tools), fmt) for c in choices]
        untrainable = train_sampling is not None and not _trainable(sampling, train_sampling)
        if not req.side:  # a side turn (a judge's, a summary's) is served, never recorded
            # every choice, one group (trained together, `TurnStore.take_judged`); greedy
            # choices are one reply n times: recorded once
            recorded = kept[:1] if sampling.greedy else kept
            await run_in_threadpool(
                store.record_choices, req.session, req.messages, prompt_ids,
                [(c.token_ids, ch.text, c.logprobs) for c, ch in zip(recorded, choices, strict=False)],
                version, req.tools, "sampling" if untrainable else None, launch,
            )  # fmt: skip
            self.metrics.turns_recorded += len(recorded)
        if req.session_done and not req.side:
            await run_in_threadpool(store.end_session, req.session)
        n_out = sum(len(c.token_ids) for c in kept)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n_out,
            "total_tokens": len(prompt_ids) + n_out,
        }
        return served, usage

    async def streamed(
        self, stream: Any, req: ChatRequest, prompt_ids: list[int], sampling: SamplingConfig
    ) -> AsyncIterator[str]:
        """Server-sent events as the engine generates: each choice's text as it comes (less
        what may yet be a stop string or a tool call, `streamable`), then, once every choice
        is done, the rest, the calls and the finish reasons; the turn is recorded before the
        last event. A client that leaves stops its generation and has nothing recorded."""
        cid, tokenizer = new_id(), self.backend.tokenizer
        fmt, launch = self.settings.tool_call_format, self.settings.launch
        tokens: list[list[int]] = [[] for _ in range(req.n)]
        sent = [""] * req.n
        call_format = fmt if req.tools else None
        started = False
        try:
            async for deltas in stream.deltas():
                if not started:  # the version is known once the request runs
                    started = True
                    for i in range(req.n):
                        role = {"role": "assistant", "content": ""}
                        yield _event(chunk_body(req, cid, stream.version, launch, i, role))
                for i in sorted({d.index for d in deltas}):
                    tokens[i] += [t for d in deltas if d.index == i for t in d.token_ids]
                    text = tokenizer.decode(tokens[i], skip_special_tokens=True)
                    shown = streamable(text, req.stop, call_format)
                    if len(shown) > len(sent[i]) and shown.startswith(sent[i]):
                        delta = {"content": shown[len(sent[i]) :]}
                        yield _event(chunk_body(req, cid, stream.version, launch, i, delta))
                        sent[i] = shown
            completions, version = stream.completions()
            served, usage = await self.finish(req, prompt_ids, sampling, completions, version)
        except BaseException:  # the client left (the task is cancelled), or the engine failed
            if not stream.done:
                self.metrics.disconnects += 1
                self.backend.cancel(stream)  # type: ignore[attr-defined]
            raise
        for i, choice in enumerate(served):
            for chunk in end_chunks(req, cid, version, launch, i, choice, sent[i]):
                yield _event(chunk)
        if req.include_usage:
            yield _event(usage_chunk(req, cid, version, launch, usage))
        yield "data: [DONE]\n\n"


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[str]:
    for chunk in chunks:
        yield _event(chunk)
    yield "data: [DONE]\n\n"


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def _finished(stream: Any) -> tuple[list[Completion], int]:
    """A `ReplyStream`'s samples and version once every one is done."""
    async for _ in stream.deltas():
        pass
    return stream.completions()


def model_card(model_name: str, created: int) -> dict[str, Any]:
    return {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "composer_lightning",
    }


def check_model(model: str, model_name: str) -> None:
    if model != model_name:
        raise ApiError(
            404, f"The model {model!r} does not exist; this server serves {model_name!r}.",
            param="model", code="model_not_found",
        )  # fmt: skip


def _render(tokenizer: Any, req: ChatRequest) -> list[int]:
    try:
        return render_ids(tokenizer, req.messages, add_generation_prompt=True, tools=req.tools)
    except Exception as e:  # jinja's TemplateError, a template's raise_exception, bad tool specs
        raise ApiError(
            400, f"the chat template refused these messages: {type(e).__name__}: {e}",
            param="messages",
        ) from None  # fmt: skip


def _sampling(
    req: ChatRequest,
    prompt_len: int,
    max_context: int | None,
    default_max_tokens: int,
    default_temperature: float = 1.0,
) -> SamplingConfig:
    room = None if max_context is None else max_context - prompt_len
    max_tokens = req.max_tokens
    if room is not None and (room < 1 or (max_tokens is not None and max_tokens > room)):
        raise ApiError(
            400, f"this model's context is {max_context} tokens; the prompt has {prompt_len} and "
            f"{max_tokens or 1} more were asked for", param="messages", code="context_length_exceeded",
        )  # fmt: skip
    if max_tokens is None:
        max_tokens = default_max_tokens if room is None else min(default_max_tokens, room)
    greedy = req.top_p == 0  # OpenAI accepts top_p=0: only the most likely token
    temperature = default_temperature if req.temperature is None else req.temperature
    return SamplingConfig(
        temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else req.top_p,
        max_tokens=max_tokens,
        seed=req.seed,
    )


def _trainable(sampling: SamplingConfig, train: SamplingConfig) -> bool:
    """Whether a turn was sampled from the distribution training log-probs are of."""
    return (
        abs(sampling.temperature - train.temperature) < 1e-9
        and sampling.top_p == 1.0
        and sampling.top_k_or_none is None
    )

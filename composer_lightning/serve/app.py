"""An OpenAI-compatible chat endpoint that records every turn it serves for training.

`POST /v1/chat/completions` renders the request's messages with the policy's chat template
once, here, generates (on the backend's engine thread, or a worker thread: the event loop keeps
serving), and records every choice as the session's next turns, one group (with n > 1 the
client continues one reply: the next request names which, and the others get an empty next
state; a group trains together, its rewards' mean as its baseline). Before that, the request
gives the session's previous turn its next state (`TurnStore.attach_next_state`). A session
ends with `session_done`, or when it stays quiet for `session_timeout_s`.

With `stream`, a backend that streams (`StepBackend`, on vLLM) sends each choice's tokens as
they are generated, holding back only what may yet be a stop string or a tool call; other
backends send the finished reply as chunks.

A client that disconnects while its reply is generated gets nothing recorded: a streaming
backend stops its generation, another drops the reply once the generation finishes.

A request's path (authorise, limit, parse, render, generate or stream, record) is
`ChatCompletions` (`serve/chat.py`); this file builds the app around it: its error answers in
OpenAI's shape, `/v1/models`, and the expiry of quiet sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from composer_lightning.chat.tool_calls import resolve_format
from composer_lightning.engines.base import SamplingConfig
from composer_lightning.serve.access import Access, RateLimiter
from composer_lightning.serve.backend import ServeBackend
from composer_lightning.serve.chat import (
    ChatCompletions,
    ChatSettings,
    ServeMetrics,
    check_model,
    model_card,
)
from composer_lightning.serve.protocol import ApiError
from composer_lightning.serve.store import TurnStore


def make_app(
    backend: ServeBackend,
    store: TurnStore,
    *,
    model_name: str,
    api_key: str | list[str] | None = None,
    max_request_bytes: int = 4 * 2**20,
    rate_limit_per_minute: int | None = None,
    max_n: int = 8,
    default_max_tokens: int = 256,
    session_timeout_s: float | None = None,
    disconnect_poll_s: float = 0.1,
    train_sampling: SamplingConfig | None = None,
    launch: int = 0,
    tool_call_format: str = "template",
) -> FastAPI:
    """The serving app.

    Args:
        backend: what generates (`EngineBackend`).
        store: where served turns are recorded.
        model_name: the one model id served (`/v1/models`); requests must name it.
        api_key: the bearer token clients must send, or a list of them (one per client); None:
            no authentication, one tenant. Sessions are owned per key: a session id names one
            of its key's sessions only (`serve/access.py`).
        max_request_bytes: larger bodies are refused with 413.
        rate_limit_per_minute: requests per client (its bearer token; without one, its address)
            per minute (429 beyond); None: off.
        max_n: the largest `n` accepted.
        default_max_tokens: reply length when a request gives none (cut to the context left).
        session_timeout_s: a recorded turn with no next request within this many seconds gets
            an empty next state (`TurnStore.expire`, checked every quarter of it); None: only
            `session_done` ends a session.
        disconnect_poll_s: how often a generation checks whether its client is still there.
        train_sampling: the sampling training rollouts use (its temperature is also the default
            of a request that names none): a turn sampled otherwise (another
            temperature, top_p < 1, greedy) is recorded and dropped at once ("sampling"), since
            its log-probs are not those the trainer computes; None: every turn is trainable.
        launch: the start of the run serving (`TurnStore.begin_launch`), recorded with each turn
            and in its `system_fingerprint` (`serve/lineage.py`); 0: none.
        tool_call_format: the format of the policy's calls in its replies, and of calls written
            into a history's text for a template that does not render `tool_calls`
            (`chat.tool_calls`): "template" (the chat template's), "auto", "hermes",
            "mistral" or "llama3_json".
    """
    if max_request_bytes < 1 or max_n < 1 or default_max_tokens < 1:
        raise ValueError(
            "max_request_bytes, max_n and default_max_tokens must be >= 1, got "
            f"{max_request_bytes!r}, {max_n!r}, {default_max_tokens!r}"
        )
    if session_timeout_s is not None and not session_timeout_s > 0:
        raise ValueError(
            f"session_timeout_s must be > 0 seconds or None, got {session_timeout_s!r}"
        )
    fmt = resolve_format(tool_call_format, backend.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        if session_timeout_s is not None:
            task = asyncio.create_task(_expire_loop(store, session_timeout_s))
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="composer_lightning serve", lifespan=lifespan, openapi_url=None)
    app.state.metrics = metrics = ServeMetrics()
    limiter = RateLimiter(rate_limit_per_minute) if rate_limit_per_minute else None
    created = int(time.time())

    def error(e: ApiError) -> JSONResponse:
        metrics.errors[e.status] += 1
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return error(
            ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)
        )

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        msg = f"the server failed: {type(e).__name__}: {e}"
        return error(ApiError(500, msg, type="server_error"))

    access = Access(api_key)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        access.caller(request)
        return {"object": "list", "data": [model_card(model_name, created)]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        access.caller(request)
        check_model(model, model_name)
        return model_card(model_name, created)

    settings = ChatSettings(
        model_name,
        max_request_bytes,
        max_n,
        default_max_tokens,
        disconnect_poll_s,
        train_sampling,
        launch,
        fmt,
    )
    chat = ChatCompletions(backend, store, settings, access, limiter, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.complete(request)

    return app


async def _expire_loop(store: TurnStore, timeout_s: float) -> None:
    while True:
        await asyncio.sleep(min(timeout_s / 4, 30.0))
        await run_in_threadpool(store.expire, timeout_s)

"""`OpenAIEngine`: a model served behind an OpenAI-compatible API, as an LLM judge.

Any server that speaks `/v1/chat/completions` works: `vllm serve` (a judge on its own GPU or
machine, beside the policy's engine), a hosted API. The judge sends chat messages and reads
text back; the server applies the model's chat template and its own stop tokens, so no local
tokenizer is needed. Requests of one call run concurrently (`max_concurrency`).

    engine: {class_path: composer_lightning.engines.OpenAIEngine,
             init_args: {base_url: "http://judge-host:8000/v1"}}
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from composer_lightning.engines.base import Completion, SamplingConfig

log = logging.getLogger(__name__)


class OpenAIEngine:
    """Chat completions from an OpenAI-compatible server (`ChatEngine`).

    Args:
        base_url: the API root, e.g. `http://127.0.0.1:8000/v1`.
        model: the served model's name; None takes the first the server lists.
        api_key: the key; default `$OPENAI_API_KEY`, else "EMPTY" (vLLM needs none).
        timeout: seconds per request.
        max_concurrency: requests in flight at once.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        max_concurrency: int = 8,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIEngine: base_url must be an http(s) URL, got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"OpenAIEngine: max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url, self.model, self.timeout = base_url.rstrip("/"), model, timeout
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.max_concurrency = max_concurrency
        self.client: Any = None

    def start(self, context: object = None) -> None:
        """Connect (and find the served model's name); a second call does nothing."""
        if self.client is not None:
            return
        from openai import OpenAI

        self.client = OpenAI(
            base_url=self.base_url, api_key=self.api_key, timeout=self.timeout, max_retries=2
        )
        if self.model is None:
            self.model = self.client.models.list().data[0].id

    def chat(
        self, conversations: list[list[dict[str, str]]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        self.start()

        def one(i: int) -> list[Completion]:
            extra: dict[str, Any] = {}
            if sampling.top_k_or_none:
                extra["top_k"] = sampling.top_k_or_none  # a vLLM extension
            if sampling.stop_token_ids:
                extra["stop_token_ids"] = list(sampling.stop_token_ids)  # likewise
            if sampling.min_p:
                extra["min_p"] = sampling.min_p  # likewise
            if sampling.repetition_penalty != 1:
                extra["repetition_penalty"] = sampling.repetition_penalty  # likewise
            extra.update(sampling.generation_kwargs)  # the server's extra sampling options
            response = self.client.chat.completions.create(
                model=self.model,
                messages=conversations[i],
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=None if sampling.seed is None else sampling.seed + i * n,
                extra_body=extra or None,
            )
            return [
                Completion(
                    token_ids=[],
                    logprobs=[],
                    text=choice.message.content or "",
                    finish_reason="length" if choice.finish_reason == "length" else "stop",
                )
                for choice in sorted(response.choices, key=lambda c: c.index)
            ]

        def guarded(i: int) -> list[Completion]:
            try:
                return one(i)
            except Exception as exc:  # one failed request fails its conversation, not the call
                log.warning(
                    "OpenAIEngine: conversation %d of %d failed (no replies for it): %s: %s",
                    i,
                    len(conversations),
                    type(exc).__name__,
                    exc,
                )
                return []

        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return list(pool.map(guarded, range(len(conversations))))

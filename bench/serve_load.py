"""`serve` under load: concurrent clients against the endpoint, batched vs one request at a time.

    python bench/serve_load.py [--clients 1 4 16 64] [--requests 4] [--max-tokens 16]
    python bench/serve_load.py --smoke

The tiny policy (`configs/serve_cpu.yaml`'s) behind `make_app` on the transformers engine, 1
thread. For each number of clients, every client sends `--requests` chat requests one after
another (temperature 1, unseeded, `--max-tokens` new tokens, ignoring EOS so every reply has
the same length) through httpx, and the bench reports requests/s, generated tokens/s and the
p50 / p99 latency for:
- batched: `EngineBackend` as `serve` runs it (requests that arrive while the engine is busy
  share its next call);
- one at a time: `EngineBackend(max_batch=1)`, each request waiting for the engine in turn
  (what `serve` did before);
- the engine alone: one `generate` call of as many prompts as there are clients, repeated
  `--requests` times: the throughput the batched endpoint is bounded by.
Not measured here: vLLM's own OpenAI server on the same model (`tests/tasks/test_served_judge.py`
starts one), and vLLM's async engine behind `serve` (it batches continuously).
`--smoke`: 1 and 2 clients, 2 requests of 2 tokens: a check that the bench runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from composer_lightning.chat import render_ids  # noqa: E402
from composer_lightning.engines import HFEngine, SamplingConfig  # noqa: E402
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from composer_lightning.serve import BackgroundServer, EngineBackend, TurnStore, make_app  # noqa: E402


class FixedLength(EngineBackend):
    """`EngineBackend` whose replies run to `max_tokens` (EOS ignored): equal work per request."""

    def generate(self, prompt_ids, n, sampling):
        return super().generate(prompt_ids, n, dataclasses.replace(sampling, ignore_eos=True))


def load(url: str, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    """`clients` threads, each sending `requests` requests in turn; throughput and latency."""
    latencies: list[float] = []
    errors: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(timeout=600) as http:
            for i in range(requests):
                body = {
                    "model": "policy",
                    "messages": [{"role": "user", "content": f"What is {k} + {i}?"}],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "session_id": f"c{k}-{i}",
                    "session_done": True,
                }
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(r.text[:200])

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="1 and 2 clients, 2 requests of 2 tokens")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.requests, args.max_tokens = [1, 2], 2, 2
    torch.set_num_threads(1)
    path = tiny_policy_path()
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(model_path=path, seed=0)
    rows = []
    for clients in args.clients:
        row = {"clients": clients}
        for name, max_batch in (("batched", 64), ("one", 1)):
            backend = FixedLength(engine, tok, max_batch=max_batch)
            with tempfile.TemporaryDirectory() as tmp:
                store = TurnStore(Path(tmp) / "turns.sqlite")
                with BackgroundServer(make_app(backend, store, model_name="policy")) as server:
                    row[name] = load(server.url, clients, args.requests, args.max_tokens)
                store.close()
            row[name]["calls"] = backend.engine_calls
        row["engine"] = engine_alone(engine, tok, clients, args.requests, args.max_tokens)
        rows.append(row)
        print(row, file=sys.stderr)
    print(
        f"tiny policy, transformers engine, 1 thread; {args.requests} requests per client of "
        f"{args.max_tokens} tokens (EOS ignored), temperature 1"
    )
    print(
        "| clients | batched req/s | batched tok/s | batched p50 s | batched p99 s | engine calls | "
        "one-at-a-time req/s | one p50 s | one p99 s | engine alone tok/s | batched / engine | "
        "batched / one |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, o, e = r["batched"], r["one"], r["engine"]
        print(
            f"| {r['clients']} | {b['req_s']:.1f} | {b['tok_s']:.0f} | {b['p50']:.3f} | "
            f"{b['p99']:.3f} | {b['calls']} | {o['req_s']:.1f} | {o['p50']:.3f} | {o['p99']:.3f} | "
            f"{e['tok_s']:.0f} | {b['tok_s'] / e['tok_s']:.2f} | {b['req_s'] / o['req_s']:.2f} |"
        )


if __name__ == "__main__":
    main()

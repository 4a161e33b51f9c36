"""Under FSDP2, where should the chunked LM head get its full weight? Measured on 2 CPU ranks.

    python bench/fsdp_lm_head.py [--tokens 3200] [--repeats 3] [--smoke]

The LM head (Qwen2.5-0.5B: 151,936 x 896, tied to the embeddings) lives in the root's FSDP2
unit. Two ways to apply it chunk by chunk to the hidden states:
- unshard once: read the weight after the root's forward, when FSDP2 keeps the root unsharded
  until its backward (what `composer_lightning.training.forward` does) — one all-gather per forward;
- per chunk: a separate FSDP unit for the head, gathered for every chunk in the forward and
  again in the checkpointed recompute (and reduce-scattered per chunk in the backward).
This times one all-gather of that weight over 2 gloo ranks and one LM-head chunk matmul
(forward + recompute + the two backward matmuls) and prints the cost of each way for a
minibatch of `--tokens` response tokens at the module's default chunk
(`training.hidden.chunk_tokens`).
`--smoke`: a 1024 x 64 head, one repeat: a check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from composer_lightning.training.hidden import chunk_tokens  # noqa: E402

V, H = 151936, 896
SMOKE_V, SMOKE_H = 1024, 64  # --smoke


def worker(out: str, repeats: int, vocab: int, hidden: int) -> None:
    """One of 2 gloo ranks: time the all-gather of a `[vocab, hidden]` head sharded over the
    ranks and one chunk's matmuls; rank 0 writes the medians to `out`."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.randn(vocab // world, hidden)
    full = torch.empty(vocab - vocab % world, hidden)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(full, shard)
        times.append(time.perf_counter() - t0)
    chunk = chunk_tokens(full, None)  # the CPU default for this head
    h = torch.randn(chunk, hidden, requires_grad=True)
    w = full.requires_grad_()
    mm = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits = h @ w.T  # forward
        with torch.no_grad():
            _ = h @ w.T  # the checkpointed recompute
        g = torch.randn_like(logits)
        torch.autograd.grad(logits, (h, w), g)  # the two backward matmuls
        mm.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "gather_s": statistics.median(times[1:]),
                    "chunk_s": statistics.median(mm[1:]),
                    "chunk": chunk,
                },
                f,
            )
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=3200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny head, 1 repeat: a check")
    ap.add_argument("--worker", metavar="OUT_JSON")
    args = ap.parse_args()
    v, h = (SMOKE_V, SMOKE_H) if args.smoke else (V, H)
    if args.worker:
        torch.set_num_threads(1)
        worker(args.worker, args.repeats, v, h)
        return
    if args.smoke:
        args.repeats = 1
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE="2",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", out, "--repeats", str(args.repeats)]
                + (["--smoke"] if args.smoke else []),
                env=dict(env, RANK=str(r)),
            )
            for r in (0, 1)
        ]
        assert all(p.wait() == 0 for p in procs)
        r = json.load(open(out))
    chunks = -(-args.tokens // r["chunk"])
    once = r["gather_s"]
    per_chunk = 2 * chunks * r["gather_s"]  # forward and recompute; the backward's
    compute = chunks * r["chunk_s"]  # reduce-scatters per chunk come on top
    print(
        f"LM head {v} x {h} fp32 over 2 gloo ranks: one all-gather {r['gather_s']:.3f} s; "
        f"one chunk of {r['chunk']} tokens (fwd + recompute + bwd) {r['chunk_s']:.3f} s"
    )
    print(
        f"| {args.tokens} response tokens, {chunks} chunks | gathers | gather s | LM-head compute s |"
    )
    print("|---|---|---|---|")
    print(f"| unshard once (root forward) | 1 | {once:.2f} | {compute:.2f} |")
    print(f"| gather per chunk | {2 * chunks} | {per_chunk:.2f} | {compute:.2f} |")


def _free_port() -> int:
    """A TCP port free now, for the ranks' rendezvous (a fixed one may be taken)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()

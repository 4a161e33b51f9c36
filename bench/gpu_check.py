"""One-shot GPU check of the real path: vLLM engine + FSDP2 + all heads + push + canary, on ONE GPU.

    python bench/gpu_check.py [--steps 5] [--time-limit 420]    # on a GPU machine
    python bench/gpu_check.py --max-staleness 1                 # generation ahead, on a GPU
    python bench/gpu_check.py --smoke                           # the same path, tiny, on CPU

The GPU run is `configs/qwen05b_gpu_fsdp.yaml`'s path built in Python (no jsonargparse
needed): a random Qwen2.5-0.5B-shaped policy (24 layers, hidden 896, vocabulary 151,936, tied
embeddings; saved to a temporary directory with the shipped tiny tokenizer, whose ids are a
subset of the vocabulary), `ModelParallelStrategy` (FSDP2) with bf16-mixed (fp32 master
weights, bf16 compute), activation checkpointing, Dr. GRPO + OPD + SDPO + replay DPO + KL,
arithmetic prompts with verifier hints, 16 prompts x G = 8 x 256 new tokens per step, one
`VLLMEngine` (vLLM 0.32, sleep mode) colocated on the same GPU, pushed to after every step.
Without vLLM installed it says so and uses `HFEngine` instead.

Prints one JSON report: s/step (median after the first), generated tokens/s, peak GPU memory,
MFU (model FLOPs of the trainer's forwards and backwards / step time / the GPU's bf16 peak),
and the canary gap. A watchdog ends the run after `--time-limit` seconds (default 7 minutes)
and prints what it has. Record the output in docs/benchmarks/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from composer_lightning.datamodules.rollout import RolloutDataModule  # noqa: E402
from composer_lightning.engines import HFEngine, SamplingConfig, VLLMEngine  # noqa: E402
from composer_lightning.heads.dr_grpo import DrGRPOHead  # noqa: E402
from composer_lightning.heads.kl import KLHead  # noqa: E402
from composer_lightning.heads.opd import OPDHead  # noqa: E402
from composer_lightning.heads.replay_dpo import ReplayDPOHead  # noqa: E402
from composer_lightning.heads.sdpo import SDPOHead  # noqa: E402
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from composer_lightning.rollout.callback import RolloutCallback  # noqa: E402
from composer_lightning.tasks import VerifierHint  # noqa: E402
from composer_lightning.training.module import ComposerModule  # noqa: E402

QWEN_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
)
SMOKE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    vocab_size=576,  # above the tiny tokenizer's 513 ids as a Qwen2 tokenizer reads them
    tie_word_embeddings=True,
)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense


def build_model(directory: str, shape: dict, dtype: torch.dtype) -> int:
    """A random Qwen2 policy with the tiny tokenizer beside it; returns its parameter count."""
    tok = tiny_policy_path()
    for name in os.listdir(tok):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(tok, name), directory)
    gen = GenerationConfig.from_pretrained(tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                **shape,
                max_position_embeddings=4096,
                bos_token_id=gen.bos_token_id,
                eos_token_id=gen.eos_token_id,
            )
        )
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    gen.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


class Report(L.Callback):
    """Step times and the logged rollout figures of every step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.gaps: list[float] = []
        self.tok_s: list[float] = []
        self.flop_tokens: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)
        m = trainer.callback_metrics
        self.gaps.append(float(m.get("rollout/logprob_gap_mean", float("nan"))))
        self.tok_s.append(float(m.get("rollout/tokens_per_s", float("nan"))))
        rb = batch.rollout
        # per parameter: forward + backward (6) + the checkpointed layers' second forward (2) +
        # the reference forward (2) on the student tokens; the teacher forward (2) on its own
        self.flop_tokens.append(
            10 * float(rb.attention_mask.sum()) + 2 * float(rb.teacher_attention_mask.sum())
        )


def report_of(rep: Report, args, params: int, engine_name: str, cuda: bool) -> dict:
    steady = rep.times[1:] or rep.times
    step_s = statistics.median(steady) if steady else float("nan")
    flops = params * (
        statistics.median(rep.flop_tokens[1:] or rep.flop_tokens) if rep.flop_tokens else 0
    )
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None) if cuda else None
    return {
        "device": name,
        "engine": engine_name,
        "params_M": round(params / 1e6, 1),
        "steps_done": len(rep.times),
        "step_s_median": round(step_s, 3),
        "gen_tokens_per_s": round(statistics.median(rep.tok_s[1:] or rep.tok_s), 1)
        if rep.tok_s
        else None,
        "peak_gpu_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "mfu": round(flops / step_s / (peak * 1e12), 4) if peak and step_s == step_s else None,
        "logprob_gap_mean_per_step": [round(g, 6) for g in rep.gaps],
        "elapsed_s": round(time.monotonic() - args.start, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=420.0, help="seconds before the watchdog")
    ap.add_argument(
        "--max-staleness", type=int, default=0, help="k > 0: the engine generates ahead"
    )
    args = ap.parse_args()
    args.start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.smoke
    has_vllm = importlib.util.find_spec("vllm") is not None
    rep = Report()
    state: dict = {"params": 0, "engine": "?"}

    def watchdog() -> None:
        time.sleep(args.time_limit)
        out = report_of(rep, args, state["params"], state["engine"], cuda)
        print(json.dumps({**out, "stopped_by": f"time limit {args.time_limit:.0f} s"}, indent=2))
        sys.stdout.flush()
        os._exit(124)

    threading.Thread(target=watchdog, daemon=True).start()
    P, G, max_tokens = (16, 8, 256) if not args.smoke else (2, 4, 8)
    with tempfile.TemporaryDirectory() as model_dir:
        state["params"] = build_model(
            model_dir, SMOKE if args.smoke else QWEN_05B, torch.bfloat16 if cuda else torch.float32
        )
        if has_vllm:
            engine = VLLMEngine(
                dtype="bfloat16" if cuda else "float32",
                gpu_memory_utilization=0.35,
                enable_sleep_mode=cuda,
                max_model_len=1024,
                kv_cache_gib=1,
            )
            state["engine"] = "vllm " + __import__("vllm").__version__
        else:
            engine = HFEngine(dtype="bfloat16" if cuda else "float32")
            state["engine"] = "hf (vLLM is not installed here)"
        heads = [
            DrGRPOHead(),
            OPDHead(weight=0.5),
            SDPOHead(weight=0.05),
            ReplayDPOHead(weight=0.02, pairs_per_step=4),
            KLHead(kl_coef=0.001),
        ]
        module = ComposerModule(
            model_dir,
            heads,
            activation_checkpointing=True,
            max_logprob_gap=0.1 if cuda else 0.05,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-6),
        )
        trainer = L.Trainer(
            accelerator="cuda" if cuda else "cpu",
            devices=1,
            strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
            precision="bf16-mixed" if cuda else "32-true",
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                RolloutCallback(
                    engine,
                    group_size=G,
                    hint=VerifierHint(),
                    hint_trust="always",  # the same teacher work at any staleness (a check
                    # needs the trainer's engine, which max_staleness > 0 moves out)
                    sampling=SamplingConfig(max_tokens=max_tokens, seed=0),
                    max_staleness=args.max_staleness,
                ),
                rep,
            ],
        )
        trainer.fit(module, RolloutDataModule(task="arithmetic", prompts_per_step=P))
        out = report_of(rep, args, state["params"], state["engine"], cuda)
        seen = trainer.callback_metrics
        out["max_staleness"] = args.max_staleness
        # parameters whose engine-side fingerprint matched the trainer's (all of them on GPUs)
        out["fingerprint_params"] = float(seen.get("rollout/fingerprint_params", 0.0))
        out["fsdp2_sharded"] = all(hasattr(p, "full_tensor") for p in module.policy.parameters())
        out["loss_finite"] = bool(
            torch.isfinite(torch.tensor(float(trainer.callback_metrics["train/loss"])))
        )
        print(json.dumps(out, indent=2))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's and gloo's interpreter teardown


if __name__ == "__main__":
    main()

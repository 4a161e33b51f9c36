"""Rollout throughput and weight-push latency: VLLMEngine vs HFEngine, side by side.

    python bench/engine_bench.py [--quick] [--repeats 3] [--threads 1] [--push-memory]

Same random Llama checkpoints, same batch (8 prompts x n=4 x 32 tokens, temperature 1, EOS
ignored, so every completion has exactly max_tokens tokens) for both engines. Throughput is
generated tokens / wall second of `generate`; push latency is `load_weights(iter_hf_weights(
policy))` (vLLM: including the prefix-cache reset) against one plain `copy_` of every weight
into a same-shaped module. Medians of `--repeats` runs after one warm-up. vLLM runs in a
subprocess of this script (an in-process vLLM engine changes its host process).

`--push-memory`: on 2 CPU ranks with the 20M model (`--quick`: the tiny one) FSDP2-sharded
over both and a vLLM engine per rank, rank 0's peak extra resident memory during a push that
streams each gathered tensor into the engine, against one that gathers every tensor first
(large allocations on mmap and `malloc_trim` before each push, so resident memory follows live
tensors).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from composer_lightning.engines import HFEngine, SamplingConfig, iter_hf_weights  # noqa: E402
from composer_lightning.models.random import build_random_llama, load_policy  # noqa: E402

MODELS = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    "20M": dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=768),
}


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab, (num, length), generator=gen).tolist()


def measure(engine, policy, prompts, n, max_tokens, repeats) -> dict:
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = len(prompts) * n * max_tokens
    gen_s = _median_time(lambda: engine.generate(prompts, n, sampling), repeats)
    push_s = _median_time(lambda: engine.load_weights(iter_hf_weights(policy), 1), repeats)
    return {"tok_per_s": tokens / gen_s, "push_ms": 1e3 * push_s}


def plain_copy_ms(policy, repeats: int) -> float:
    target = [p.detach().clone() for p in policy.parameters()]
    source = [p.detach() for p in policy.parameters()]

    def copy_all():
        with torch.no_grad():
            for dst, src in zip(target, source, strict=True):
                dst.copy_(src)

    return 1e3 * _median_time(copy_all, repeats)


class PeakRSS:
    """The peak resident memory above the level at entry, sampled every 0.2 ms by a thread."""

    def __enter__(self) -> PeakRSS:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory back to the OS first
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def push_memory_worker(model_dir: str, out_json: str, repeats: int) -> None:
    """One of two ranks: FSDP2-shard the policy over both, start a vLLM engine on the trainer's
    group (external_launcher), and measure the peak extra memory of pushes that stream each
    gathered full tensor into the engine against pushes that gather every tensor first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from composer_lightning.engines import EngineContext, VLLMEngine

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain, policy = load_policy(model_dir), load_policy(model_dir)
    sizes = [p.numel() * p.element_size() for p in policy.parameters()]
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    engine = VLLMEngine(model_dir, dtype="float32")
    engine.start(EngineContext.current())
    out = {"largest_param_mb": max(sizes) / 2**20, "all_params_mb": sum(sizes) / 2**20}
    # "engine_only": an unsharded module's tensors pass by reference, so the push's extra memory
    # is the engine's own (vLLM's in-place reload buffers), the floor for the others
    for name, weights in (
        ("engine_only", lambda: iter_hf_weights(plain)),
        ("streamed", lambda: iter_hf_weights(policy)),
        ("materialised", lambda: list(iter_hf_weights(policy))),
    ):
        peaks = []
        for _ in range(repeats + 1):  # the first push also warms vLLM's reload path
            with PeakRSS() as peak:
                engine.load_weights(weights(), 1)
            peaks.append(peak.extra_mb)
        out[f"{name}_push_extra_mb"] = statistics.median(peaks[1:])
    Path(out_json).write_text(json.dumps(out))
    dist.barrier()


def run_push_memory(model_dir: str, args: argparse.Namespace) -> dict:
    """`push_memory_worker` on 2 CPU ranks; rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MALLOC_MMAP_THRESHOLD_="65536",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE="2",
        )
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--push-worker",
                    model_dir,
                    f"{tmp}/rank{r}.json",
                    f"--repeats={args.repeats}",
                ],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"push-memory ranks failed:\n{errors[0][-3000:]}")
        return json.loads(Path(f"{tmp}/rank0.json").read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_worker(model_dir: str, args: argparse.Namespace) -> dict:
    from composer_lightning.engines import VLLMEngine

    policy = load_policy(model_dir)
    engine = VLLMEngine(model_dir, dtype="float32")
    prompts = _prompts(args.prompts, args.prompt_len, policy.config.vocab_size)
    return measure(engine, policy, prompts, args.n, args.max_tokens, args.repeats)


def run_vllm(model_dir: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--vllm-worker", model_dir, out.name, *_shared_args(args)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM bench subprocess failed:\n{proc.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())


def _shared_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--repeats={args.repeats}",
        f"--threads={args.threads}",
        f"--prompts={args.prompts}",
        f"--prompt-len={args.prompt_len}",
        f"--n={args.n}",
        f"--max-tokens={args.max_tokens}",
    ]


def print_push_memory(rows) -> None:
    for name, _, _, vl, _ in rows:
        if vl and "streamed_push_extra_mb" in vl:
            print(
                f"\npush of FSDP2-sharded weights (2 CPU ranks) into each rank's vLLM engine, "
                f"{name} model: rank 0's peak extra memory (median of the pushes after the first)"
            )
            print(
                "| largest parameter | all parameters | engine's own buffers (unsharded push) | "
                "streamed push | materialised push |"
            )
            print("|---|---|---|---|---|")
            print(
                f"| {vl['largest_param_mb']:.1f} MiB | {vl['all_params_mb']:.1f} MiB | "
                f"{vl['engine_only_push_extra_mb']:.1f} MiB | {vl['streamed_push_extra_mb']:.1f} MiB | "
                f"{vl['materialised_push_extra_mb']:.1f} MiB |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 16 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--push-memory",
        action="store_true",
        help="also measure the peak extra memory of an FSDP2 push on 2 ranks (20M; --quick: tiny)",
    )
    parser.add_argument("--push-worker", nargs=2, metavar=("MODEL_DIR", "OUT_JSON"))
    parser.add_argument("--vllm-worker", nargs=2, metavar=("MODEL_DIR", "OUT_JSON"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.push_worker:
        push_memory_worker(*args.push_worker, args.repeats)
        sys.stdout.flush()
        os._exit(0)
    if args.vllm_worker:
        result = vllm_worker(args.vllm_worker[0], args)
        Path(args.vllm_worker[1]).write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's slow interpreter teardown
    if args.quick:
        args.max_tokens = 16
    has_vllm = __import__("importlib").util.find_spec("vllm") is not None
    names = ["tiny"] if args.quick else list(MODELS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_dir = build_random_llama(Path(tmp) / name, **MODELS[name])
            policy = load_policy(model_dir)
            params = sum(p.numel() for p in policy.parameters())
            prompts = _prompts(args.prompts, args.prompt_len, policy.config.vocab_size)
            hf = measure(
                HFEngine(model=policy), policy, prompts, args.n, args.max_tokens, args.repeats
            )
            copy_ms = plain_copy_ms(policy, args.repeats)
            vl = run_vllm(model_dir, args) if has_vllm else None
            if vl and args.push_memory and name == names[-1]:  # 20M (--quick: tiny)
                vl.update(run_push_memory(model_dir, args))
            rows.append((name, params, hf, vl, copy_ms))
    batch = f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens"
    print(f"batch: {batch}, temperature 1, {args.threads} thread(s), median of {args.repeats}")
    head = (
        "model",
        "params",
        "HF tok/s",
        "vLLM tok/s",
        "vLLM/HF",
        "copy_ ms",
        "HF push ms",
        "vLLM push ms",
        "vLLM push/copy_",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, params, hf, vl, copy_ms in rows:
        v_tok = f"{vl['tok_per_s']:.0f}" if vl else "n/a"
        ratio = f"{vl['tok_per_s'] / hf['tok_per_s']:.1f}x" if vl else "n/a"
        v_push = f"{vl['push_ms']:.2f}" if vl else "n/a"
        push_ratio = f"{vl['push_ms'] / copy_ms:.1f}x" if vl else "n/a"
        cells = (
            name,
            f"{params / 1e6:.2f}M",
            f"{hf['tok_per_s']:.0f}",
            v_tok,
            ratio,
            f"{copy_ms:.2f}",
            f"{hf['push_ms']:.2f}",
            v_push,
            push_ratio,
        )
        print("| " + " | ".join(cells) + " |")
    print_push_memory(rows)


if __name__ == "__main__":
    main()

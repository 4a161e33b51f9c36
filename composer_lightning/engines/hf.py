"""A rollout engine on transformers' `generate`: slow, dependency-free, exact in fp32.

It owns its own copy of the policy, so a weight push is a real copy and a stale engine is
possible (which the canary must catch). All prompts of a call are generated in one left-padded
batch; the trainer's global RNG is never touched (sampling runs under `fork_rng`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor, nn

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
from composer_lightning.models.weights import hf_name


class HFEngine:
    """Sample with `transformers` `generate` on a private copy of the policy.

    Args:
        model_path: a saved HF causal LM or a hub id (`models/hub.py`); None: the policy's directory (given by the rollout
            callback at `start`), or `model`.
        model: a module to copy (deep copy, at once; not an FSDP-sharded one).
        dtype: the engine copy's dtype ("float32", "bfloat16", ...).
        device: where the engine copy lives; None: the rank's device.
        seed: seeds the engine's own generator, used when `SamplingConfig.seed` is None.
    """

    def __init__(
        self,
        model_path: str | None = None,
        model: nn.Module | None = None,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
    ) -> None:
        if model_path is not None and model is not None:
            raise ValueError("pass at most one of model_path or model")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"HFEngine: dtype {dtype!r} is not a torch dtype name")
        model_path = resolve_model_dir(model_path, "HFEngine")  # a hub id: fetched now, once
        self.model_path, self.dtype, self.seed = model_path, dtype, seed
        self._source, self._device = model, device
        self.model: Any = None  # an HF causal LM once started (its own types lose `.to`)
        self._rng = random.Random(seed)  # picklable: an engine may start in a child
        self._version = 0
        if model is not None:  # a given module is copied now, as it is
            self.start(EngineContext(device=device or "cpu"))

    def start(self, context: EngineContext | None = None) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM, GenerationConfig

        context = context or EngineContext.current()
        torch_dtype = getattr(torch, self.dtype)
        if self._source is not None:
            model = copy.deepcopy(self._source)
        else:
            path = self.model_path or context.model_path
            if path is None:
                raise ValueError(
                    "HFEngine needs model_path (or model): the policy is not a "
                    "model directory it could follow"
                )
            path = resolve_model_dir(path, "HFEngine")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        self.eos_token_ids = model_eos_ids(generation_config=model.generation_config)
        self.device = torch.device(self._device or context.device)
        self.model = model.to(device=self.device, dtype=torch_dtype).eval().requires_grad_(False)
        # A clean generation config: the checkpoint's defaults (top_k=50, penalties) would
        # otherwise leak into sampling; its EOS ids are kept above.
        self.model.generation_config = GenerationConfig()
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._source = None

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    def reset_cache(self) -> None:
        """No-op: `generate` keeps no KV cache between calls."""

    def sleep(self) -> None:
        """No-op: the copy stays where it is."""

    def wake_up(self) -> None:
        """No-op."""

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.start()
        for name, tensor in weights:
            key = hf_name(name)
            if key not in self._params:
                raise KeyError(f"HFEngine.load_weights: unknown parameter {name!r}")
            self._params[key].copy_(tensor)
        self._version = int(version)
        self.reset_cache()

    @torch.no_grad()
    def weight_fingerprint(self) -> Fingerprint:
        """The fingerprint of the weights this engine samples with (`engines/fingerprint.py`)."""
        self.start()
        return module_fingerprint(self.model.named_parameters())

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        return self.generate_stream(prompts, n, sampling, None)

    def generate_stream(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        on_delta: Callable[[int, Delta], None] | None,
    ) -> list[list[Completion]]:
        """`generate`, calling `on_delta(i, delta)` for prompt `i` after each sampling step
        (`TokenStreamEngine`): the step's token of each running sample and its log-prob."""
        check_prompts(prompts, n)
        if not prompts:
            return []
        self.start()
        seed = resolve_seed(sampling, self._rng)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(seed)
            if sampling.repetition_penalty == 1 and not sampling.generation_kwargs:
                return self._generate(prompts, n, sampling, on_delta)
            # transformers' penalties count the left padding as prompt tokens (the pad id, an
            # EOS, would be penalised): one call per prompt length, none padded
            results: list[list[Completion]] = [[] for _ in prompts]
            for length in sorted({len(p) for p in prompts}):
                rows = [i for i, p in enumerate(prompts) if len(p) == length]
                report = None if on_delta is None else _remapped(on_delta, rows)
                outs = self._generate([prompts[i] for i in rows], n, sampling, report)
                for i, out in zip(rows, outs, strict=True):
                    results[i] = out
            return results

    def _generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        on_delta: Callable[[int, Delta], None] | None = None,
    ) -> list[list[Completion]]:
        stops = sampling.stops(self.eos_token_ids)
        pad_id = stops[0] if stops else 0
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1
        greedy = sampling.greedy  # below GREEDY_BELOW, as vLLM's engine decodes
        # a greedy call passes no sampler flags: transformers warns on each ("not valid and may
        # be ignored: ['top_k']"), once per call, on stderr
        warpers = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k_or_none or 0,  # 0 disables HF's top-k warper
            "min_p": sampling.min_p or None,
        }
        options = {
            "do_sample": not greedy,
            **({} if greedy else warpers),
            "repetition_penalty": sampling.repetition_penalty,
            "max_new_tokens": sampling.max_tokens,
            "min_new_tokens": 0,
            **sampling.generation_kwargs,  # the user's word wins
        }
        feed = None if on_delta is None else _StepFeed(n, set(stops), on_delta)
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            num_return_sequences=n,
            eos_token_id=list(stops) or None,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_scores=True,  # processed scores: what was sampled from
            **({} if feed is None else {"stopping_criteria": [feed.criterion()]}),
            **options,
        )
        if feed is not None:
            feed.finish()
        generated: Tensor = out.sequences[:, width:].cpu()  # [P x n, L]
        scores = torch.stack(out.scores, dim=1).float()  # [P x n, L, V]
        # Filtered (top-k/top-p) entries are -inf; sampled tokens are always finite.
        logprobs = scores.log_softmax(-1).gather(-1, generated.to(scores.device)[..., None])
        logprobs = logprobs[..., 0].cpu()  # [P x n, L]
        stop_set = set(stops)
        results: list[list[Completion]] = []
        for i in range(len(prompts)):
            row_completions = []
            for j in range(n):
                tokens = generated[i * n + j].tolist()
                reason: Literal["stop", "length"]
                end, reason = len(tokens), "length"
                for t, tok in enumerate(tokens):
                    if tok in stop_set:
                        end, reason = t + 1, "stop"
                        break
                row_completions.append(
                    Completion(
                        token_ids=tokens[:end],
                        logprobs=logprobs[i * n + j, :end].tolist(),
                        finish_reason=reason,
                    )
                )
            results.append(row_completions)
        return results


def _remapped(on_delta: Callable[[int, Delta], None], rows: list[int]) -> Callable:
    """`on_delta` for a call of the prompts `rows`: its prompt i is the caller's `rows[i]`."""
    return lambda i, delta: on_delta(rows[i], delta)


class _StepFeed:
    """Each sampling step's tokens, as transformers samples them: read by a stopping
    criterion (called after every step with the sequences so far and the processed scores the
    step sampled from, which `output_scores` records) that never stops anything. Each running
    sample's new token and its log-prob are reported; a sample ends at its first stop id
    ("stop"), or at the end ("length"); transformers pads it after its stop."""

    def __init__(self, n: int, stops: set[int], on_delta: Callable[[int, Delta], None]):
        self.n, self.stops, self.on_delta = n, stops, on_delta
        self.running: list[bool] | None = None

    def criterion(self) -> Any:
        from transformers import StoppingCriteria

        feed = self

        class _Report(StoppingCriteria):
            def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
                feed.step(input_ids[:, -1], scores[-1])
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return _Report()

    def step(self, tokens: Tensor, scores: Tensor) -> None:
        lps = scores.float().log_softmax(-1).gather(-1, tokens[:, None])[:, 0].tolist()
        ids = tokens.tolist()
        if self.running is None:
            self.running = [True] * len(ids)
        for row, (token, lp) in enumerate(zip(ids, lps, strict=True)):
            if not self.running[row]:
                continue
            stop = token in self.stops
            self.running[row] = not stop
            delta = Delta("", row % self.n, [token], [lp], "stop" if stop else None)
            self.on_delta(row // self.n, delta)

    def finish(self) -> None:
        """The samples still running ran out of tokens: their last delta says "length"."""
        for row, running in enumerate(self.running or []):
            if running:
                self.on_delta(row // self.n, Delta("", row % self.n, [], [], "length"))

"""Weight fingerprints: does the engine hold exactly the weights of the version it claims?

The log-prob canary sees a lost push only when the update moved the log-probs by more than the
precision's noise: in bf16 a healthy gap is ≈1e-2, one missed step at lr 1e-4 moves it by
0.009–0.03, so no threshold separates them. A fingerprint does, at any precision: the float64
sum of every parameter's values, cast first to the engine's dtype (the cast the engine's own
weight loader does), taken by the trainer from the tensors it pushes and by the engine from the
parameters it holds after the push. The two differ only by the order of summation (a relative
1e-13 at 1e8 values) unless a weight differs; one AdamW step moves a parameter's sum by far more
(≈ lr · √numel, ≥ 1e-6 relative to its absolute sum at lr 1e-6).

Names: engines report their own parameter names. vLLM fuses `q/k/v_proj` into `qkv_proj` and
`gate/up_proj` into `gate_up_proj` (Llama, Qwen2, Mistral, ...); a fused parameter's sum is the
sum of its parts. A parameter the engine cannot read back is left out of its fingerprint:
vLLM's CPU backend repacks linear weights into oneDNN handles (the parameter is emptied), so
there the fingerprint covers embeddings, norms, biases and the LM head — every one of which an
update moves — and on GPUs every parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Fingerprint",
    "FingerprintRecorder",
    "fingerprint_mismatches",
    "module_fingerprint",
    "tensor_fingerprint",
]

#: name → (float64 sum, float64 sum of absolute values) of one parameter; a trainer's entry
#: may hold a second pair, the sums before the cast to the engine's dtype (an engine may keep
#: a parameter, a norm or a bias, in float32 beside bf16 weights).
Fingerprint = dict[str, tuple[float, ...]]

#: vLLM's stacked parameters: the HF leaf names whose tensors one engine parameter holds.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_FUSED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

#: Relative tolerance of a match: summation order only (float64 accumulation of ≤ 1e9 values).
RTOL = 1e-9


#: Values per float64 chunk of a CPU fingerprint (512 KiB: it stays in cache).
CHUNK = 2**16


def tensor_fingerprint(tensor: Tensor, dtype: torch.dtype | None = None) -> tuple[float, float]:
    """`(sum, sum |x|)` in float64 of `tensor` after a cast to `dtype` (the engine's)."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.device.type != "cpu":  # one pass, accumulated in float64 without a float64 copy
        return (
            float(torch.sum(t, dtype=torch.float64)),
            float(torch.linalg.vector_norm(t, 1, dtype=torch.float64)),
        )
    # On CPU, float64 copies of cache-sized chunks: no float64 copy of the whole tensor (an
    # embedding can be 1e8 values) and ≈ 5x faster than the one-pass float64 accumulation.
    total = absolute = 0.0
    for part in t.reshape(-1).split(CHUNK):
        wide = part.double()
        total += float(wide.sum())
        absolute += float(wide.abs().sum())
    return total, absolute


def module_fingerprint(named: Iterable[tuple[str, Tensor]]) -> Fingerprint:
    """The fingerprint of the parameters an engine holds; empty (unreadable) ones are left
    out. `named` is e.g. `model.named_parameters()`."""
    return {name: tensor_fingerprint(t) for name, t in named if t.numel() > 0 and not t.is_meta}


class FingerprintRecorder:
    """Fingerprint the `(hf_name, tensor)` stream of a push as the engine consumes it (no
    second gather of sharded weights).

    Args:
        weights: the push's stream.
        dtype: the engine's dtype, or None to keep each tensor's own.
    """

    def __init__(self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None):
        self._weights, self._dtype = weights, dtype
        self.fingerprint: Fingerprint = {}

        self._stream = self._record()

    @classmethod
    def for_engine(cls, weights: Iterable[tuple[str, Tensor]], engine: Any) -> FingerprintRecorder:
        """A recorder in `engine`'s dtype (its `dtype` attribute, a torch dtype's name; an
        engine without one: each tensor's own)."""
        dtype = getattr(torch, str(getattr(engine, "dtype", "")), None)
        return cls(weights, dtype if isinstance(dtype, torch.dtype) else None)

    def _record(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self._weights:
            cast: tuple[float, ...] = tensor_fingerprint(tensor, self._dtype)
            if self._dtype is not None and tensor.dtype != self._dtype:
                cast += tensor_fingerprint(tensor)  # as it is, too
            self.fingerprint[name] = cast
            yield name, tensor

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self._stream

    def finish(self) -> Fingerprint:
        """Consume what the engine left of the stream (a gather is a collective: every rank
        goes to the end) and return the fingerprint of all of it."""
        for _ in self._stream:
            pass
        return self.fingerprint


def _fused(name: str) -> str:
    """The engine parameter that holds HF parameter `name` (`...q_proj.weight` → `...qkv_proj
    .weight`); the name itself when it is not fused."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        parts[-2] = _FUSED[parts[-2]]
    return ".".join(parts)


def fingerprint_mismatches(trainer: Fingerprint, engine: Fingerprint) -> tuple[list[str], int]:
    """The engine parameters whose sums differ from the trainer's, and how many were compared.

    An engine parameter is compared with the trainer's parameter of the same name, else with
    the sum of the trainer's parameters that vLLM fuses into it; one with no counterpart is not
    compared (an engine-only buffer). It matches the trainer's sums after the cast to the
    engine's dtype or, where recorded, before it.
    """
    fused: dict[str, list[str]] = {}
    for name in trainer:
        fused.setdefault(_fused(name), []).append(name)
    bad, compared = [], 0
    for name, (engine_sum, *_) in engine.items():
        parts = [name] if name in trainer else fused.get(name, [])
        if not parts:
            continue
        compared += 1
        variants = max(len(trainer[p]) for p in parts) // 2
        for v in range(variants):
            pairs = [trainer[p][2 * v : 2 * v + 2] or trainer[p][:2] for p in parts]
            total, scale = sum(s for s, _ in pairs), sum(a for _, a in pairs)
            if abs(engine_sum - total) <= RTOL * scale + 1e-30:
                break
        else:
            bad.append(name)
    return bad, compared

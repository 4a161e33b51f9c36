"""Weight fingerprints against hand-derived sums: the cast to the engine's dtype, vLLM's fused
parameters, and what is not compared."""

from __future__ import annotations

import torch

from composer_lightning.engines.fingerprint import (
    FingerprintRecorder,
    fingerprint_mismatches,
    module_fingerprint,
    tensor_fingerprint,
)


def test_a_fingerprint_is_the_float64_sum_after_the_engines_cast():
    t = torch.tensor([1.0 + 2**-10, -3.0, 0.5], dtype=torch.float32)
    assert tensor_fingerprint(t) == (1.0 + 2**-10 - 3.0 + 0.5, 1.0 + 2**-10 + 3.0 + 0.5)
    # bf16 keeps 8 bits of mantissa: 1 + 2^-10 rounds to 1
    assert tensor_fingerprint(t, torch.bfloat16) == (-1.5, 4.5)


def test_fused_engine_parameters_compare_with_the_sum_of_their_parts():
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    gate, up = torch.randn(5, 3), torch.randn(5, 3)
    norm = torch.rand(3)
    hf = [
        ("model.layers.0.self_attn.q_proj.weight", q),
        ("model.layers.0.self_attn.k_proj.weight", k),
        ("model.layers.0.self_attn.v_proj.weight", v),
        ("model.layers.0.mlp.gate_proj.weight", gate),
        ("model.layers.0.mlp.up_proj.weight", up),
        ("model.layers.0.input_layernorm.weight", norm),
    ]
    trainer = FingerprintRecorder(hf, None).finish()
    engine = module_fingerprint(
        [
            ("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v])),
            ("model.layers.0.mlp.gate_up_proj.weight", torch.cat([gate, up])),
            ("model.layers.0.input_layernorm.weight", norm),
            ("model.layers.0.self_attn.o_proj.weight", torch.empty(0)),  # repacked: unreadable
            ("model.rotary_emb.cos_sin_cache", torch.ones(2)),  # the engine's own
        ]
    )
    assert "model.layers.0.self_attn.o_proj.weight" not in engine
    assert fingerprint_mismatches(trainer, engine) == ([], 3)
    k2 = k.clone()
    k2[1, 2] += 1e-6  # one weight, one ulp-sized step away
    engine_k = module_fingerprint(
        [("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k2, v]).double())]
    )
    assert fingerprint_mismatches(trainer, engine_k) == (
        ["model.layers.0.self_attn.qkv_proj.weight"],
        1,
    )


def test_the_recorder_passes_the_stream_through_and_finishes_what_is_left():
    stream = [("a.weight", torch.ones(2)), ("b.weight", torch.full((3,), 2.0))]
    recorder = FingerprintRecorder(stream, None)
    first = next(iter(recorder))
    assert first[0] == "a.weight" and torch.equal(first[1], torch.ones(2))
    assert recorder.finish() == {"a.weight": (2.0, 2.0), "b.weight": (6.0, 6.0)}


def test_an_engine_may_keep_a_parameter_in_its_own_precision():
    """The trainer records a bf16 engine's sums after the cast and as the tensor is: a norm the
    engine keeps in float32 matches too; a lost value matches neither."""
    w = torch.tensor([1.0 + 2**-10, 2.0])
    norm = torch.tensor([0.5 + 2**-12, 1.0])
    trainer = FingerprintRecorder([("w.weight", w), ("norm.weight", norm)], torch.bfloat16).finish()
    engine = module_fingerprint([("w.weight", w.bfloat16()), ("norm.weight", norm)])
    assert fingerprint_mismatches(trainer, engine) == ([], 2)
    stale = module_fingerprint([("w.weight", w.bfloat16()), ("norm.weight", norm + 1e-3)])
    assert fingerprint_mismatches(trainer, stale) == (["norm.weight"], 2)

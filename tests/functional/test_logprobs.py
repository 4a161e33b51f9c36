"""Shifted log-probs / entropies against per-position loops; chunked versions against full."""

import math

import pytest
import torch

from composer_lightning.functional import (
    chunked_entropy_from_hidden,
    chunked_logprobs_from_hidden,
    entropy_from_logits,
    logprobs_from_logits,
    sequence_logprobs,
)


def log_softmax(xs, tau):
    top = max(x / tau for x in xs)
    lse = top + math.log(sum(math.exp(x / tau - top) for x in xs))
    return [x / tau - lse for x in xs]


def make(seed, b=2, t=5, v=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, v, (b, t), generator=g)
    return logits, ids


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_logprobs_and_entropy_match_loops(tau):
    logits, ids = make(0)
    lp, ent = logprobs_from_logits(logits, ids, tau), entropy_from_logits(logits, tau)
    for b in range(2):
        assert lp[b, 0].item() == 0.0 and ent[b, 0].item() == 0.0
        for t in range(1, 5):
            dist = log_softmax(logits[b, t - 1].tolist(), tau)  # position t-1 predicts token t
            assert abs(lp[b, t].item() - dist[ids[b, t].item()]) < 1e-12
            assert abs(ent[b, t].item() + sum(math.exp(x) * x for x in dist)) < 1e-12


def test_half_precision_is_upcast_and_single_token():
    logits, ids = make(1)
    assert logprobs_from_logits(logits.bfloat16(), ids).dtype == torch.float32
    assert entropy_from_logits(logits.half()).dtype == torch.float32
    assert logprobs_from_logits(logits[:, :1], ids[:, :1]).tolist() == [[0.0], [0.0]]


def test_sequence_logprobs():
    lp = torch.tensor([[0.0, -1.0, -2.0, math.nan], [0.0, -0.5, -0.25, -4.0]], dtype=torch.float64)
    lp.requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float64)
    out = sequence_logprobs(lp, mask)
    assert out.tolist() == [-3.0, -4.25]
    out.sum().backward()
    assert lp.grad.tolist() == mask.tolist()


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 1024])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_chunked_match_full_values_and_gradients(chunk_size, tau):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    cot = torch.randn(2, 5, generator=g, dtype=torch.float64)  # a generic upstream gradient

    for chunked, full in [
        (
            lambda: chunked_logprobs_from_hidden(hidden, weight, ids, tau, chunk_size),
            lambda: logprobs_from_logits(hidden @ weight.T, ids, tau),
        ),
        (
            lambda: chunked_entropy_from_hidden(hidden, weight, tau, chunk_size),
            lambda: entropy_from_logits(hidden @ weight.T, tau),
        ),
    ]:
        got, want = chunked(), full()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        g_got = torch.autograd.grad((got * cot).sum(), (hidden, weight))
        g_want = torch.autograd.grad((want * cot).sum(), (hidden, weight))
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_chunked_keeps_no_vocabulary_sized_tensor_for_backward():
    """Autograd saves no chunk x V logits (only the inputs of each checkpointed chunk and the
    weight itself); the full-logits path saves B x (T-1) x V."""
    hidden = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 50, (2, 9))
    sizes = []

    def pack(x):
        if x.data_ptr() != weight.data_ptr():
            sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        chunked_logprobs_from_hidden(hidden, weight, ids, chunk_size=4)
        chunked_entropy_from_hidden(hidden, weight, chunk_size=4)
    assert 0 < max(sizes) < 50
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logprobs_from_logits(hidden @ weight.T, ids)
    assert max(sizes) >= 2 * 8 * 50


def test_chunked_under_no_grad_and_short_sequences():
    hidden, weight = torch.randn(3, 1, 4), torch.randn(6, 4)
    with torch.no_grad():
        out = chunked_logprobs_from_hidden(hidden, weight, torch.zeros(3, 1, dtype=torch.long))
    assert out.shape == (3, 1) and (out == 0).all()
    assert chunked_entropy_from_hidden(hidden.bfloat16(), weight.bfloat16()).dtype == torch.float32


def test_errors():
    logits, ids = make(3)
    with pytest.raises(ValueError, match=r"temperature must be in \(0, inf\), got 0"):
        logprobs_from_logits(logits, ids, 0)
    with pytest.raises(ValueError, match=r"temperature must be in \(0, inf\), got -1.0"):
        entropy_from_logits(logits, -1.0)
    with pytest.raises(ValueError, match=r"logits \[2, 5, 7\] and input_ids \[2, 4\] must agree"):
        logprobs_from_logits(logits, ids[:, :4])
    with pytest.raises(ValueError, match=r"logprobs \[2, 5\] and response_mask \[2, 4\]"):
        sequence_logprobs(torch.zeros(2, 5), torch.ones(2, 4))
    hidden, weight = torch.randn(2, 5, 4), torch.randn(7, 4)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer, got 0"):
        chunked_logprobs_from_hidden(hidden, weight, ids, chunk_size=0)
    with pytest.raises(ValueError, match=r"lm_head_weight \[4, 7\] must be \[V, H\]"):
        chunked_entropy_from_hidden(hidden, weight.T)
    with pytest.raises(ValueError, match=r"hidden \[2, 5, 4\] and input_ids \[2, 3\]"):
        chunked_logprobs_from_hidden(hidden, weight, ids[:, :3])

"""Shifted log-probs / entropies against per-position loops and a reduced vocabulary."""

import math

import pytest
import torch

from composer_lightning.functional import (
    entropy_from_logits,
    logprobs_from_logits,
    sequence_logprobs,
)
from composer_lightning.functional.logprobs import scaled_logits, upcast


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


@pytest.mark.parametrize("tau", [1.0, 0.7, 0.1])
def test_masked_vocabulary_equals_the_vocabulary_without_it(tau):
    """Entries at -inf (a masked vocabulary) give the reduced vocabulary's log-probs and
    entropies, finite gradients, and exactly zero gradient on the masked entries."""
    masked, kept = [1, 4, 5], torch.tensor([0, 2, 3, 6])
    logits, _ = make(4)
    logits[..., masked] = -math.inf
    logits.requires_grad_(True)
    reduced = logits.detach()[..., kept].requires_grad_(True)
    ids_reduced = torch.randint(0, 4, (2, 5), generator=torch.Generator().manual_seed(5))
    ids = kept[ids_reduced]
    for fn, fn_reduced in [
        (
            lambda: logprobs_from_logits(logits, ids, tau),
            lambda: logprobs_from_logits(reduced, ids_reduced, tau),
        ),
        (lambda: entropy_from_logits(logits, tau), lambda: entropy_from_logits(reduced, tau)),
    ]:
        logits.grad = reduced.grad = None
        got, want = fn(), fn_reduced()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        got.sum().backward()
        want.sum().backward()
        assert torch.isfinite(logits.grad).all() and (logits.grad[..., masked] == 0).all()
        torch.testing.assert_close(logits.grad[..., kept], reduced.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_scaled_logits_passes_finite_logits_through_bit_identically(dtype):
    x = (torch.randn(3, 4, 9, dtype=torch.float64) * 30).to(dtype).requires_grad_(True)
    cot = torch.randn(3, 4, 9, dtype=upcast(x).dtype)
    got, want = scaled_logits(x, 0.7), upcast(x) / 0.7
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad((y * cot).sum(), x)[0] for y in (got, want)))
    assert scaled_logits(torch.tensor([-math.inf], dtype=dtype), 0.01).isfinite().all()


def test_sequence_logprobs():
    lp = torch.tensor([[0.0, -1.0, -2.0, math.nan], [0.0, -0.5, -0.25, -4.0]], dtype=torch.float64)
    lp.requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float64)
    out = sequence_logprobs(lp, mask)
    assert out.tolist() == [-3.0, -4.25]
    out.sum().backward()
    assert lp.grad.tolist() == mask.tolist()


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

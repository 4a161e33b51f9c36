"""Log-probs in vocabulary tiles (`functional/vocab_tiles.py`) against full float64 logits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from composer_lightning.functional.logprobs import scaled_logits
from composer_lightning.functional.vocab_tiles import MIN_TILE, tile_shape, tiled_logprobs


def full_logprobs(hidden, weight, targets, tau):
    """The reference: every `[N, V]` logit at once, log-softmax, gather."""
    lp = torch.log_softmax(scaled_logits(hidden @ weight.T, tau), dim=-1)
    return lp.gather(-1, targets.reshape(len(targets), -1)).view(targets.shape)


def inputs(n, v, h, k=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,) if k is None else (n, k), generator=g)
    if k is not None and n:
        targets[0, 1] = targets[0, 0]  # a repeated id gets each share of the gradient
    cot = torch.randn(targets.shape, generator=g, dtype=torch.float64)
    return hidden, weight, targets, cot


@pytest.mark.parametrize(
    ("n", "v", "elements"),
    [
        (7, 11, 1),  # one row, one vocabulary entry a tile
        (7, 11, 5),  # one row, tiles of 5 and a last of 1
        (7, 600, 300),  # one row (300 // 256), tiles of 300
        (7, 600, 7 * 257 + 2),  # every row, tiles of 257 (the last 86)
        (30, 1000, 3000),  # 11 rows a block (the last 8), tiles of 272 (the last 184)
        (30, 1000, 30 * 257),  # every row, tiles of 257 (the last 229)
        (30, 1000, 10**6),  # one piece
    ],
)
@pytest.mark.parametrize("tau", [1.0, 0.6])
@pytest.mark.parametrize("k", [None, 3])
def test_tiles_equal_full_logits_values_and_gradients(n, v, elements, tau, k):
    hidden, weight, targets, cot = inputs(n, v, 5, k)
    got = tiled_logprobs(hidden, weight, targets, tau, elements)
    want = full_logprobs(hidden, weight, targets, tau)
    assert got.shape == targets.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    g_got = torch.autograd.grad((got * cot).sum(), (hidden, weight))
    g_want = torch.autograd.grad((want * cot).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_a_tile_of_floored_logits_gets_no_probability_and_no_gradient():
    """A vocabulary tile whose logits are all -inf (a masked-out stretch of the vocabulary)
    is floored as `scaled_logits` floors it: probability 0, gradient 0, nothing NaN."""
    hidden, weight, targets, cot = inputs(6, 40, 4)
    targets = targets % 20  # the targets in the first half
    floor = torch.zeros(40, dtype=torch.float64)
    floor[20:] = -torch.inf  # the second half: two whole tiles of 10

    h = torch.cat([hidden, torch.ones(6, 1, dtype=torch.float64)], dim=1)  # logits + floor,
    w = torch.cat([weight, floor[:, None]], dim=1)  # through the weight's last column
    got = tiled_logprobs(h, w, targets, 0.7, 10)  # one row a block, tiles of 10
    want = full_logprobs(h, w, targets, 0.7)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    (g_got,) = torch.autograd.grad((got * cot).sum(), hidden)
    (g_want,) = torch.autograd.grad((want * cot).sum(), hidden)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-10)


def test_no_rows_is_empty_and_attached():
    hidden, weight, targets, _ = inputs(0, 11, 4)
    out = tiled_logprobs(hidden, weight, targets, 1.0, 5)
    assert out.shape == (0,) and out.grad_fn is not None
    grads = torch.autograd.grad(out.sum(), (hidden, weight))
    assert grads[0].shape == (0, 4) and not grads[1].any()


def test_tile_shape_keeps_every_row_until_a_tile_would_be_narrower_than_min_tile():
    assert tile_shape(100, 50_000, 100 * 1000) == (100, 1000)
    assert tile_shape(100, 50_000, 100 * MIN_TILE) == (100, MIN_TILE)
    assert tile_shape(100, 50_000, 10 * MIN_TILE) == (10, MIN_TILE)  # fewer rows, not thinner
    assert tile_shape(100, 50_000, 10**9) == (100, 50_000)  # never wider than the vocabulary
    assert tile_shape(100, 50, 1) == (1, 1)  # the budget's floor: one logit
    assert tile_shape(0, 50, 10) == (1, 10)


class Widest(TorchDispatchMode):
    """The most elements of any tensor an operator creates (views and in-place writes aside),
    other than the inputs' and the weight gradient's own shapes."""

    def __init__(self, skip) -> None:
        super().__init__()
        self.skip, self.widest = {tuple(s) for s in skip}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func._schema.is_mutable or func.is_view):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.skip:
                    self.widest = max(self.widest, t.numel())
        return out


@pytest.mark.parametrize("elements", [40, 400, 4000])
def test_no_tensor_outgrows_the_budget_forward_or_backward(elements):
    """Only `[rows, tile]` logits exist, rows x tile <= the budget, in the forward and the
    backward; the saved tensors are the inputs and one log-normaliser a row."""
    n, v, h = 50, 400, 3
    hidden, weight, targets, _ = inputs(n, v, h)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.shape) or x, lambda x: x
    ):
        mode = Widest([(n, h), (v, h)])
        with mode:
            out = tiled_logprobs(hidden, weight, targets, 1.0, elements)
            torch.autograd.grad(out.sum(), (hidden, weight))
    rows, tile = tile_shape(n, v, elements)
    assert rows * tile <= max(elements, MIN_TILE)
    assert max(mode.widest, n) == max(rows * tile, n)  # the tiles, or the [N] row statistics
    assert sorted(saved) == sorted([(n, h), (v, h), (n, 1), (n,)])


def test_under_autocast_the_matmuls_run_in_bf16_and_the_gradients_come_back_fp32():
    """As autocast runs the full-logits path: values to fp32 resolution of bf16 logits,
    gradients to bf16's; and the tiles' two passes see the same logits, so each row's
    probabilities sum to one (a gradient of a constant grad is orthogonal to ones)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, 8, generator=g, requires_grad=True)
    weight = torch.randn(700, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 700, (12,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tiled_logprobs(hidden, weight, ids, 1.0, 12 * 300)
        want = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, ids[:, None])[:, 0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    g_got = torch.autograd.grad(got.sum(), (hidden, weight))
    g_want = torch.autograd.grad(want.sum(), (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"hidden \(torch.float32\) and lm_head_weight"):
        tiled_logprobs(hidden, weight.double(), ids, 1.0, 100)

"""Chunked log-probs, entropies and JSD from hidden states against the full-logits versions."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from composer_lightning.functional import (
    chunked_entropy_from_hidden,
    chunked_generalized_jsd,
    chunked_logprobs_from_hidden,
    entropy_from_logits,
    generalized_jsd_per_token,
    logprobs_from_logits,
)


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


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_chunked_with_a_mask_computes_only_the_masked_tokens(chunk_size):
    """Masked-in tokens equal the full-logits values (and gradients); the others are exactly 0
    and send no gradient; an all-False mask gives zeros still attached to the graph."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.rand(3, 6, generator=g) < 0.5
    mask[0, 0] = True  # column 0 has no predictor: 0 even when selected
    cot = torch.randn(3, 6, generator=g, dtype=torch.float64)
    keep = mask.clone()
    keep[:, 0] = False
    for chunked, full in [
        (
            lambda m: chunked_logprobs_from_hidden(hidden, weight, ids, 0.8, chunk_size, mask=m),
            lambda: logprobs_from_logits(hidden @ weight.T, ids, 0.8),
        ),
        (
            lambda m: chunked_entropy_from_hidden(hidden, weight, 0.8, chunk_size, mask=m),
            lambda: entropy_from_logits(hidden @ weight.T, 0.8),
        ),
    ]:
        got, want = chunked(mask), full() * keep
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        g_got = torch.autograd.grad((got * cot).sum(), (hidden, weight))
        g_want = torch.autograd.grad((want * cot).sum(), (hidden, weight))
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        none = chunked(torch.zeros_like(mask))
        assert torch.all(none == 0) and none.requires_grad
    with pytest.raises(ValueError, match=r"mask \[3, 5\] must be \[B, T\]"):
        chunked_logprobs_from_hidden(hidden, weight, ids, mask=mask[:, :5])


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


# ------------------------------------------------------------------ generalised JSD


def jsd_inputs(n=7, h=4, h_teacher=5, v=11, seed=0):
    """float64 student (with grad) and teacher hidden states / LM heads; the teacher's hidden
    size differs from the student's on purpose."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return (
        randn(n, h).requires_grad_(True),
        randn(v, h).requires_grad_(True),
        randn(n, h_teacher),
        randn(v, h_teacher),
    )


# Some but not all capped quantities must exceed the cap (checked in the test), so that both
# clamp branches are exercised: "median" puts the token cap between the two middle values.
JSD_CLIPS = [(None, "element"), (0.08, "element"), ("median", "token")]


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
@pytest.mark.parametrize("tau", [0.7, 1.5])
@pytest.mark.parametrize(("clip", "mode"), JSD_CLIPS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_chunked_jsd_matches_full_values_and_gradients(beta, clip, mode, tau, chunk_size):
    sh, sw, th, tw = jsd_inputs()
    th.requires_grad_(True)  # must be detached inside: no gradient may reach the teacher
    tw.requires_grad_(True)
    if clip == "median":
        free, _ = generalized_jsd_per_token(sh @ sw.T, th @ tw.T, beta=beta, temperature=tau)
        lo, hi = free.detach().sort().values[3:5].tolist()
        assert hi - lo > 1e-6  # no token near the cap, where the clamp is not smooth
        clip = (lo + hi) / 2
    kw = {"beta": beta, "temperature": tau, "clip": clip, "clip_mode": mode}
    got, got_capped = chunked_generalized_jsd(sh, sw, th, tw, chunk_size=chunk_size, **kw)
    want, want_capped = generalized_jsd_per_token(sh @ sw.T, th.detach() @ tw.detach().T, **kw)
    assert got.shape == got_capped.shape == (7,) and not got_capped.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_capped, want_capped, rtol=0, atol=1e-12)
    if clip is not None:
        assert 0 < want_capped.mean() < 1
    cot = torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g_got = torch.autograd.grad((got * cot).sum(), (sh, sw))
    g_want = torch.autograd.grad((want * cot).sum(), (sh, sw))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert th.grad is None and tw.grad is None


def test_chunked_jsd_no_tokens_is_empty_and_attached():
    sh, sw, th, tw = jsd_inputs()
    sh = sh.detach()[:0].requires_grad_(True)  # [0, H]
    th = th[:0]
    per_token, capped = chunked_generalized_jsd(sh, sw, th, tw, clip=0.1)
    assert per_token.shape == capped.shape == (0,) and per_token.requires_grad
    per_token.sum().backward()
    assert sh.grad.shape == (0, 4)
    assert sw.grad is not None and (sw.grad == 0).all()


def test_chunked_jsd_half_precision_and_no_grad():
    sh, sw, th, tw = (x.detach().bfloat16() for x in jsd_inputs())
    per_token, capped = chunked_generalized_jsd(sh, sw, th, tw, chunk_size=2)
    assert per_token.dtype == capped.dtype == torch.float32
    want, _ = generalized_jsd_per_token(sh @ sw.T, th @ tw.T)  # also upcast after the matmul
    torch.testing.assert_close(per_token, want, rtol=0, atol=1e-6)
    with torch.no_grad():
        assert not chunked_generalized_jsd(sh, sw, th, tw, chunk_size=2)[0].requires_grad


def test_chunked_jsd_saves_no_vocabulary_sized_tensor_for_backward():
    """Between forward and backward autograd holds only the inputs ([N, H] rows and the two
    weights); the full-logits path holds [N, V] tensors."""
    n, v, chunk = 40, 50, 8
    sh, sw, th, tw = jsd_inputs(n=n, h=3, h_teacher=3, v=v)
    sizes = []

    def pack(x):
        if x.data_ptr() not in (sw.data_ptr(), tw.data_ptr()):
            sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        chunked_generalized_jsd(sh, sw, th, tw, chunk_size=chunk, clip=0.1)
    assert max(sizes) == n * 3 < n * v
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        generalized_jsd_per_token(sh @ sw.T, th @ tw.T, clip=0.1)
    assert max(sizes) >= n * v


class VocabularyRows(TorchDispatchMode):
    """Tracks the peak number of live `[*, V]` rows among the tensors created under it."""

    def __init__(self, v: int) -> None:
        super().__init__()
        self.v, self.live, self.peak = v, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == self.v:
                key = t.untyped_storage().data_ptr()
                if key not in self.live:  # one entry per storage (views share it)
                    self.live[key] = t.untyped_storage().nbytes() // t.element_size() // self.v
                    weakref.finalize(t, self.live.pop, key, None)
                    self.peak = max(self.peak, sum(self.live.values()))
        return out


def test_chunked_jsd_peak_logits_do_not_grow_with_tokens():
    """Through the forward and the (recomputing) backward, the vocabulary-wide rows alive at
    once are bounded by the chunk size, whatever N; on the full-logits path they grow with N."""
    v, chunk = 50, 8

    def peak(n, fn):
        sh, sw, th, tw = jsd_inputs(n=n, h=3, h_teacher=3, v=v)
        mode = VocabularyRows(v)
        with mode:
            fn(sh, sw, th, tw).sum().backward()
        return mode.peak

    def chunked(*args):
        return chunked_generalized_jsd(*args, beta=0.3, chunk_size=chunk)[0]

    def full(sh, sw, th, tw):
        return generalized_jsd_per_token(sh @ sw.T, th @ tw.T, beta=0.3)[0]

    assert peak(3 * chunk, chunked) == peak(12 * chunk, chunked) < 3 * chunk * 12
    assert peak(12 * chunk, full) > 12 * chunk * 4  # several [N, V] tensors


class WeightShaped(TorchDispatchMode):
    """Counts the tensors of one shape (the LM head's `[V, H]`) that operators create."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or func.is_view:  # in place (addmm_) or a view: no new
            return out  # memory (a vocabulary tile as wide as the vocabulary is a view)
        self.count += sum(
            isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape for t in tree_leaves(out)
        )
        return out


@pytest.mark.parametrize("which", ["logprobs", "entropy", "jsd", "topk"])
def test_chunked_backward_makes_one_weight_gradient_whatever_the_chunks(which):
    """The backward sums every chunk's `[V, H]` weight gradient in place into one buffer: one
    `[V, H]`-shaped tensor is created for 1 chunk and for 12 (autograd per checkpointed chunk
    made a new one per chunk, and a new sum per chunk)."""
    from composer_lightning.functional.topk_opd import chunked_logprobs_at

    v, h, n = 50, 3, 24
    sh, sw, th, tw = jsd_inputs(n=n, h=h, h_teacher=h, v=v)
    ids = torch.randint(0, v, (n, 4), generator=torch.Generator().manual_seed(0))
    fns = {
        "logprobs": lambda c: chunked_logprobs_from_hidden(sh[None], sw, ids[None, :, 0], 1.0, c),
        "entropy": lambda c: chunked_entropy_from_hidden(sh[None], sw, 1.0, c),
        "jsd": lambda c: chunked_generalized_jsd(sh, sw, th, tw, chunk_size=c)[0],
        "topk": lambda c: chunked_logprobs_at(sh, sw, ids, 1.0, c),
    }
    counts, grads = [], []
    for chunk in (n, 2):
        out = fns[which](chunk)
        mode = WeightShaped(sw.shape)
        with mode:
            (grad,) = torch.autograd.grad(out.sum(), sw)
        counts.append(mode.count)
        grads.append(grad)
    assert counts == [1, 1]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


def test_chunked_under_autocast_matches_autocast_on_full_logits():
    """Under bf16 autocast the LM head's matmuls run in bf16 as autocast runs them (and the
    fp32 weight's gradient comes back fp32): values and gradients equal the full-logits path
    under the same autocast to bf16's resolution."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 40, (2, 6), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_logprobs_from_hidden(hidden, weight, ids, chunk_size=3)
        want = logprobs_from_logits(hidden @ weight.T, ids)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    g_got = torch.autograd.grad(got.sum(), (hidden, weight))
    g_want = torch.autograd.grad(want.sum(), (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"hidden \(torch.float32\) and lm_head_weight"):
        chunked_logprobs_from_hidden(hidden, weight.double(), ids)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"chunk_size": 0}, r"chunk_size must be a positive integer, got 0"),
        ({"chunk_size": 2.0}, r"chunk_size must be a positive integer, got 2.0"),
        ({"chunk_size": True}, r"chunk_size must be a positive integer, got True"),
        ({"beta": 1.5}, r"beta must be in \[0, 1\], got 1.5"),
        ({"clip_mode": "row"}, r"clip_mode 'row'; expected one of scale, element, token"),
        ({0: torch.zeros(3, 4, 1)}, r"student_hidden must be 2-D, got shape \[3, 4, 1\]"),
        ({1: torch.zeros(11, 3)}, r"student_weight \[11, 3\] must be \[V, H\] for student_hidden"),
        ({3: torch.zeros(11, 4)}, r"teacher_weight \[11, 4\] must be \[V, H\] for teacher_hidden"),
        ({2: torch.zeros(6, 5)}, r"student_hidden \[7, 4\] and teacher_hidden \[6, 5\] must have"),
        ({3: torch.zeros(12, 5)}, r"student_weight \[11, 4\] and teacher_weight \[12, 5\] must"),
    ],
)
def test_chunked_jsd_bad_arguments(change, pattern):
    args = [x.detach().float() for x in jsd_inputs()]
    for i, x in change.items():
        if isinstance(i, int):
            args[i] = x
    kwargs = {k: x for k, x in change.items() if isinstance(k, str)}
    with pytest.raises(ValueError, match=pattern):
        chunked_generalized_jsd(*args, **kwargs)


def test_errors():
    ids = torch.randint(0, 7, (2, 5))
    hidden, weight = torch.randn(2, 5, 4), torch.randn(7, 4)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer, got 0"):
        chunked_logprobs_from_hidden(hidden, weight, ids, chunk_size=0)
    with pytest.raises(ValueError, match=r"lm_head_weight \[4, 7\] must be \[V, H\]"):
        chunked_entropy_from_hidden(hidden, weight.T)
    with pytest.raises(ValueError, match=r"hidden \[2, 5, 4\] and input_ids \[2, 3\]"):
        chunked_logprobs_from_hidden(hidden, weight, ids[:, :3])


def test_the_default_chunk_is_small_on_cpu_and_large_on_an_accelerator():
    """The module's default tokens per chunk: ≈ 8 MiB of fp32 logits on CPU (glibc keeps freed
    heap: small chunks keep the peak low), 64 MiB on an accelerator (a kernel launch per chunk),
    and at least H / 8 tokens (each chunk's backward passes over the [V, H] gradient); a given
    chunk_size always wins."""
    from composer_lightning.training.hidden import chunk_tokens

    def head(v, h, device="cpu"):
        return torch.empty(v, h, device=device)

    assert chunk_tokens(head(151936, 64), None) == 13
    assert chunk_tokens(head(49152, 64), None) == 42
    assert chunk_tokens(head(151936, 896), None) == 112  # 896 / 8
    assert chunk_tokens(head(151936, 64, "meta"), None) == 110  # not CPU: 64 MiB
    assert chunk_tokens(head(151936, 64), 7) == 7 and chunk_tokens(head(10**7, 2), None) == 1


@pytest.mark.parametrize("tau", [1.0, 0.6])
@pytest.mark.parametrize("k", [None, 3])
def test_the_log_probs_closed_form_gradient_equals_autograd(tau, k):
    """`logprobs_logits_grad`, which the vocabulary tiles' backward (and the token chunks'
    baseline) uses in place of autograd for log-probs, over whole rows, equals autograd through the log-probs in float64: with -inf logits (a masked
    vocabulary), a temperature, one target a row or several with a repeated id. From bf16
    logits it is float32 and equals autograd's float32 gradient before the cast back."""
    from composer_lightning.functional.logprobs import scaled_logits
    from composer_lightning.functional.vocab_tiles import logprobs_logits_grad

    g = torch.Generator().manual_seed(7)
    n, v = 5, 13
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    logits[:, -2:] = float("-inf")
    shape = (n,) if k is None else (n, k)
    targets = torch.randint(0, v - 2, shape, generator=g)
    if k is not None:
        targets[:, 1] = targets[:, 0]  # a repeated id gets both shares
    grad = torch.randn(shape, generator=g, dtype=torch.float64)

    def autograd(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        s = scaled_logits(x, tau)
        t = targets.reshape(n, -1)
        lp = s.gather(-1, t) - torch.logsumexp(s, dim=-1, keepdim=True)
        (out,) = torch.autograd.grad((lp * grad.reshape(n, -1).to(lp.dtype)).sum(), x)
        return out

    got = logprobs_logits_grad(logits, grad, targets, tau)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    torch.testing.assert_close(got, autograd(logits), rtol=0, atol=1e-12)
    assert (got[:, -2:] == 0).all()  # a masked entry gets exactly no gradient
    half = logits.bfloat16()
    got = logprobs_logits_grad(half, grad.float(), targets, tau)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, autograd(half.float()), rtol=0, atol=1e-6)

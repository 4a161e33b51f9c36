"""Generalised JSD against a per-vocabulary-entry loop reference, TRL's values, gradcheck."""

import math

import pytest
import torch
import torch.nn.functional as F

from composer_lightning.functional import generalized_jsd, generalized_jsd_per_token


def softmax(xs, tau):
    top = max(xs)
    e = [math.exp((x - top) / tau) for x in xs]
    return [v / sum(e) for v in e]


def plogq(p, q):
    """p * log(p / q), with 0 log 0 = 0 (an entry at -inf has p = 0)."""
    return 0.0 if p == 0 else p * math.log(p / q)


def ref_terms(s, t, beta, tau):
    """Per-vocabulary-entry terms of the divergence for one token (plain Python)."""
    ps, pt = softmax(s, tau), softmax(t, tau)
    if beta == 0:
        return [plogq(b, a) for a, b in zip(ps, pt, strict=True)]
    if beta == 1:
        return [plogq(a, b) for a, b in zip(ps, pt, strict=True)]
    out = []
    for a, b in zip(ps, pt, strict=True):
        m = beta * b + (1 - beta) * a
        out.append(beta * plogq(b, m) + (1 - beta) * plogq(a, m))
    return out


def ref_token(s, t, beta, tau, clip, mode):
    """(value, share of the divergence the clip removed) for one token."""
    terms = ref_terms(s, t, beta, tau)
    total = sum(terms)
    if clip is None:
        return total, 0.0
    value = sum(min(x, clip) for x in terms) if mode == "element" else min(total, clip)
    # "scale" and "token" have the same value; they differ in the gradient
    return value, (total - value) / total if total > 0 else 0.0


def logits(seed, shape, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


CLIPS = [(None, "element"), (0.05, "element"), (0.3, "token"), (0.3, "scale")]


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize(("clip", "mode"), CLIPS)
def test_matches_loop_reference(beta, clip, mode):
    s, t = logits(0, (2, 3, 5)), logits(1, (2, 3, 5))
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    kw = {"beta": beta, "temperature": 1.7, "clip": clip, "clip_mode": mode}
    per_token, capped = generalized_jsd_per_token(s, t, mask, **kw)
    values = []
    for b in range(2):
        for i in range(3):
            if not mask[b, i]:
                assert per_token[b, i].item() == 0.0 and capped[b, i].item() == 0.0
                continue
            want, frac = ref_token(s[b, i].tolist(), t[b, i].tolist(), beta, 1.7, clip, mode)
            assert abs(per_token[b, i].item() - want) < 1e-12
            assert abs(capped[b, i].item() - frac) < 1e-12
            values.append(want)
    assert (
        abs(generalized_jsd(s, t, mask.double(), **kw).item() - sum(values) / len(values)) < 1e-12
    )


def test_trl_known_values():
    """TRL's convention at S = [.1, .9], T = [.9, .1]: both KLs 1.75778, beta=.1 -> 0.14631,
    beta=.5 -> 0.36806 (`tests/test_gkd_trainer.py` style check)."""
    s = torch.tensor([[0.1, 0.9]], dtype=torch.float64).log()
    t = torch.tensor([[0.9, 0.1]], dtype=torch.float64).log()
    for beta, want in [(0.0, 1.75778), (1.0, 1.75778), (0.1, 0.14631), (0.5, 0.36806)]:
        assert abs(generalized_jsd(s, t, beta=beta).item() - want) < 5e-6
    # and exactly: KL = .9 ln 9 - .1 ln 9 = .8 ln 9
    assert abs(generalized_jsd(s, t, beta=0.0).item() - 0.8 * math.log(9)) < 1e-14


def test_end_points_are_the_kls_and_interior_is_discontinuous():
    s, t = logits(2, (4, 6)), logits(3, (4, 6))
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    forward = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1).mean()  # KL(T || S)
    reverse = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1).mean()  # KL(S || T)
    assert abs(generalized_jsd(s, t, beta=0.0).item() - forward.item()) < 1e-12
    assert abs(generalized_jsd(s, t, beta=1.0).item() - reverse.item()) < 1e-12
    assert generalized_jsd(s, t, beta=1e-9).item() < 1e-6  # interior -> 0 at the ends, not a KL


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_zero_on_equal_and_nonnegative(beta):
    s = logits(4, (3, 4, 7))
    assert abs(generalized_jsd(s, s.clone(), beta=beta).item()) < 1e-15
    per_token, _ = generalized_jsd_per_token(s, logits(5, (3, 4, 7)), beta=beta, temperature=0.6)
    assert (per_token >= 0).all()


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize(("clip", "mode"), [c for c in CLIPS if c[1] != "scale"])
def test_gradcheck(beta, clip, mode):
    # "scale" is not the derivative of its value by design (a detached factor): tested below
    # seeds chosen so that, for every case, some but not all capped quantities exceed the cap
    s, t = logits(16, (2, 2, 4), scale=1.5), logits(17, (2, 2, 4), scale=1.5)
    mask = torch.tensor([[1, 1], [0, 1]], dtype=torch.bool)
    if clip is not None:  # none within 1e-3 of the cap (clamp not smooth there); some capped
        capped = []
        for b, i in [(0, 0), (0, 1), (1, 1)]:
            terms = ref_terms(s[b, i].tolist(), t[b, i].tolist(), beta, 1.3)
            for x in terms if mode == "element" else [sum(terms)]:
                assert abs(x - clip) > 1e-3
                capped.append(x > clip)
        assert any(capped) and not all(capped)
    kw = {"beta": beta, "temperature": 1.3, "clip": clip, "clip_mode": mode}
    s.requires_grad_(True)
    t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: generalized_jsd(a, b, mask, **kw), (s, t))


def test_element_vs_token_clip_hand_example():
    """beta = 0 (KL(T || S)) at S = [.1, .9], T = [.9, .1]: entry terms .9 ln 9 = 1.97750 and
    .1 ln(1/9) = -0.21972, sum 1.75778. clip = 0.5: element -> 0.5 - 0.21972 = 0.28028, the
    clip removed (1.97750 - 0.5) / 1.75778 = 0.84055 of the divergence; token -> min(1.75778,
    0.5) = 0.5, removed 1.25778 / 1.75778 = 0.71555."""
    s = torch.tensor([[0.1, 0.9]], dtype=torch.float64).log().requires_grad_(True)
    t = torch.tensor([[0.9, 0.1]], dtype=torch.float64).log()
    el, el_frac = generalized_jsd_per_token(s, t, beta=0.0, clip=0.5, clip_mode="element")
    tok, tok_frac = generalized_jsd_per_token(s, t, beta=0.0, clip=0.5, clip_mode="token")
    total = 0.8 * math.log(9)  # .9 ln 9 - .1 ln 9
    assert abs(el.item() - (0.5 - 0.1 * math.log(9))) < 1e-14
    assert abs(el_frac.item() - (0.9 * math.log(9) - 0.5) / total) < 1e-14
    assert tok.item() == 0.5 and abs(tok_frac.item() - (total - 0.5) / total) < 1e-14
    tok.sum().backward()
    assert (s.grad == 0).all()  # a capped token passes no gradient


def test_masked_positions_zero_gradient_nan_does_not_leak():
    s, t = logits(8, (2, 3, 5)), logits(9, (2, 3, 5))
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.float64)
    s[0, 1], t[1, 0] = math.nan, math.inf
    s.requires_grad_(True)
    loss = generalized_jsd(s, t, mask, beta=0.5, clip=0.05)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(s.grad).all()
    assert (s.grad[0, 1] == 0).all() and (s.grad[1, 0] == 0).all()
    assert (s.grad[0, 0] != 0).any()


MASKED = [1, 4, 5]  # vocabulary entries at -inf
KEPT = [0, 2, 3, 6]


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize(("clip", "mode"), CLIPS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_vocabulary_masked_in_both_equals_the_vocabulary_without_it(beta, clip, mode, tau):
    """Entries at -inf in both distributions change nothing: the values (and the gradient on
    the other entries) are those of the reduced vocabulary, the masked entries get exactly 0."""
    s, t = logits(12, (2, 3, 7)), logits(13, (2, 3, 7))
    s[..., MASKED], t[..., MASKED] = -math.inf, -math.inf
    s.requires_grad_(True)
    s_kept = s.detach()[..., KEPT].requires_grad_(True)
    kw = {"beta": beta, "temperature": tau, "clip": clip, "clip_mode": mode}
    got, got_capped = generalized_jsd_per_token(s, t, **kw)
    want, want_capped = generalized_jsd_per_token(s_kept, t[..., KEPT], **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_capped, want_capped, rtol=0, atol=1e-12)
    got.sum().backward()
    want.sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[..., MASKED] == 0).all()
    torch.testing.assert_close(s.grad[..., KEPT], s_kept.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("clip", "mode"), CLIPS)
@pytest.mark.parametrize("beta", [0.3, 0.5, 1.0])
def test_vocabulary_masked_in_the_student_only(beta, clip, mode):
    """p_S = 0 where the teacher has mass: finite for beta > 0 (the loop reference with
    0 log 0 = 0); the masked entries get exactly zero gradient, the others the right one."""
    s, t = logits(14, (2, 3, 7)), logits(15, (2, 3, 7))
    s[..., MASKED] = -math.inf
    s.requires_grad_(True)
    per_token, capped = generalized_jsd_per_token(
        s, t, beta=beta, temperature=0.8, clip=clip, clip_mode=mode
    )
    for b in range(2):
        for i in range(3):
            want, frac = ref_token(s[b, i].tolist(), t[b, i].tolist(), beta, 0.8, clip, mode)
            assert abs(per_token[b, i].item() - want) < 1e-10
            assert abs(capped[b, i].item() - frac) < 1e-9
    per_token.sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[..., MASKED] == 0).all()
    if clip is None:  # (a cap may hide every token's gradient)

        def on_kept(x):
            full = s.detach().index_copy(-1, torch.tensor(KEPT), x)
            return generalized_jsd(full, t, beta=beta, temperature=0.8)

        assert torch.autograd.gradcheck(on_kept, (s.detach()[..., KEPT].requires_grad_(True),))


def test_two_dim_input_and_empty_mask():
    s, t = logits(10, (4, 5)), logits(11, (4, 5))
    assert torch.allclose(
        generalized_jsd(s, t), generalized_jsd(s[None], t[None]), rtol=0, atol=1e-15
    )
    s.requires_grad_(True)
    out = generalized_jsd(s, t, torch.zeros(4, dtype=torch.bool))
    assert out.item() == 0.0 and out.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"beta": 1.5}, r"beta must be in \[0, 1\], got 1.5"),
        ({"beta": -0.1}, r"got -0.1"),
        ({"temperature": 0.0}, r"temperature must be in \(0, inf\), got 0.0"),
        ({"clip": 0.0}, r"clip must be in \(0, inf\), got 0.0"),
        (
            {"clip": 0.1, "clip_mode": "row"},
            r"clip_mode 'row'; expected one of scale, element, token",
        ),
    ],
)
def test_bad_arguments(kwargs, pattern):
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=pattern):
        generalized_jsd(x, x, **kwargs)


def test_shape_errors():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(
        ValueError, match=r"student_logits \[2, 3, 4\] and teacher_logits \[2, 3, 5\]"
    ):
        generalized_jsd(x, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"mask \[2, 4\] must match student_logits \[2, 3, 4\]"):
        generalized_jsd(x, x, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"student_logits must be 2-D or 3-D"):
        generalized_jsd(torch.zeros(4), torch.zeros(4))


def test_scale_clip_bounds_the_value_and_keeps_the_gradient_direction():
    """`scale`: value min(D, c), gradient min(1, c / D) * grad D (float64, against the gradient
    of the unclipped divergence by autograd)."""
    s, t = logits(21, (6, 5)), logits(22, (6, 5))
    clip = 0.3
    s1 = s.clone().requires_grad_(True)
    full, _ = generalized_jsd_per_token(s1, t, beta=0.5, temperature=0.9)
    full.sum().backward()
    assert (full > clip).any() and (full < clip).any()
    factor = (clip / full.detach()).clamp(max=1.0)
    for i in range(6):  # per token: the gradient of its own divergence, scaled
        si = s.clone().requires_grad_(True)
        d, _ = generalized_jsd_per_token(si, t, beta=0.5, temperature=0.9)
        (d[i]).backward()
        sc = s.clone().requires_grad_(True)
        v, share = generalized_jsd_per_token(sc, t, beta=0.5, temperature=0.9, clip=clip)
        v[i].backward()
        assert abs(v[i].item() - min(full[i].item(), clip)) < 1e-12
        assert abs(share[i].item() - (1 - factor[i].item())) < 1e-12
        assert torch.allclose(sc.grad, factor[i] * si.grad, atol=1e-14, rtol=0)
        assert sc.grad.abs().sum() > 0  # never silenced


def test_element_clip_silences_the_confident_disagreement_and_scale_does_not():
    """Teacher sure of token 0 (the hint's answer), student sure of token 1 (its wrong guess):
    at beta = 0.5 every entry's term over 0.05 is capped, and those are the only entries whose
    gradient would move mass from 1 to 0. Element clip: the student's gradient on those two
    logits is 0 (exactly, up to the tail's tiny terms); scale: it points from 1 to 0."""
    s = torch.tensor([[-3.0, 4.0, 0.0, 0.0]], dtype=torch.float64)
    t = torch.tensor([[4.0, -3.0, 0.0, 0.0]], dtype=torch.float64)
    grads = {}
    for mode in ("element", "scale"):
        x = s.clone().requires_grad_(True)
        v, share = generalized_jsd_per_token(x, t, beta=0.5, clip=0.05, clip_mode=mode)
        v.sum().backward()
        grads[mode] = x.grad[0]
    el, sc = grads["element"], grads["scale"]
    assert el[:2].abs().max() < 1e-2 * sc[:2].abs().max()  # silenced where it matters
    assert sc[0] < 0 < sc[1]  # descent raises the teacher's token, lowers the student's guess

"""Top-k OPD: overlap, hint selection, subsets, the surrogate and the head, against plain-Python
float64 references built from full logits."""

from __future__ import annotations

import math

import pytest
import torch

from composer_lightning.chat import TraceSample
from composer_lightning.functional.topk_opd import (
    candidate_overlap,
    chunked_logprobs_at,
    logprobs_at_given_lse,
    select_candidates,
    topk_from_hidden,
    topk_opd_per_token,
)
from composer_lightning.heads.topk_opd import TopKOPDHead
from composer_lightning.rollout.packing import pack_samples
from composer_lightning.training.module import ComposerModule
from tests.helpers import context, full_logits, tiny_model


def test_overlap_counts_shared_ids():
    student = torch.tensor([[3, 1, 4]])
    cands = torch.tensor([[[1, 5, 9], [4, 3, 1], [0, 2, 6]]])
    assert candidate_overlap(student, cands).tolist() == [[1, 3, 0]]


def test_selection_rules_by_hand():
    # B = 1, C = 3 (shortest first), T = 3; token 2 is not counted
    overlap = torch.tensor([[[1, 2, 4], [2, 2, 0], [3, 0, 0]]])
    mask = torch.tensor([[True, True, False]])
    every = torch.tensor([[True, True, True]])
    # sums over counted tokens: 3, 4, 3 -> candidate 1
    assert select_candidates(overlap, every, mask, "sequence_optimal").tolist() == [[1, 1, 1]]
    # per token: argmax of (1, 2, 3) -> 2; of (2, 2, 0) -> a tie, the shorter: 0; token 2 is
    # not counted (all zero) -> 0
    assert select_candidates(overlap, every, mask, "token_optimal").tolist() == [[2, 0, 0]]
    assert select_candidates(overlap, every, mask, "shortest").tolist() == [[0, 0, 0]]
    # an unavailable candidate is never chosen
    some = torch.tensor([[False, False, True]])
    for rule in ("sequence_optimal", "token_optimal", "shortest"):
        assert select_candidates(overlap, some, mask, rule).tolist() == [[2, 2, 2]]
    # sum tie between candidates 0 and 2 (both 3) when 1 is gone: the shorter (0)
    no1 = torch.tensor([[True, False, True]])
    assert select_candidates(overlap, no1, mask, "sequence_optimal").tolist() == [[0, 0, 0]]


def test_topk_and_logprobs_at_from_hidden_equal_full_logits():
    g = torch.Generator().manual_seed(0)
    h, w = (
        torch.randn(7, 5, generator=g, dtype=torch.float64),
        torch.randn(11, 5, generator=g, dtype=torch.float64),
    )
    lp = torch.log_softmax(h @ w.T / 0.7, dim=-1)
    at = torch.randint(0, 11, (7, 3), generator=g)
    ids, top, at_lp, lse = topk_from_hidden(h, w, 4, 0.7, chunk_size=3, at=at)
    assert torch.equal(ids, lp.topk(4, dim=-1).indices)
    assert torch.allclose(top, lp.gather(-1, ids), atol=1e-12, rtol=0)
    assert torch.allclose(at_lp, lp.gather(-1, at), atol=1e-12, rtol=0)
    assert torch.allclose(logprobs_at_given_lse(h, w, at, lse, 0.7), at_lp, atol=1e-12, rtol=0)
    hg, wg = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = chunked_logprobs_at(hg, wg, at, 0.7, chunk_size=2)
    (got * torch.arange(21, dtype=torch.float64).view(7, 3)).sum().backward()
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = torch.log_softmax(hr @ wr.T / 0.7, dim=-1).gather(-1, at)
    (want * torch.arange(21, dtype=torch.float64).view(7, 3)).sum().backward()
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert torch.allclose(hg.grad, hr.grad, atol=1e-12) and torch.allclose(
        wg.grad, wr.grad, atol=1e-12
    )


def _surrogate_reference(cur, old, teacher, subset, gap_clip, lo, hi):
    """Plain Python: per token Σ_{v in S} max(−A ρ, −A clip(ρ)), A = softmax_S(old)·clamp(gap)."""
    out = []
    for n in range(len(cur)):
        S = [k for k in range(len(cur[n])) if subset[n][k]]
        z = sum(math.exp(old[n][k]) for k in S)
        total = 0.0
        for k in S:
            w = math.exp(old[n][k]) / z
            gap = teacher[n][k] - old[n][k]
            if gap_clip is not None:
                gap = max(-gap_clip, min(gap_clip, gap))
            a = w * gap
            r = math.exp(cur[n][k] - old[n][k])
            total += max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
        out.append(total)
    return out


@pytest.mark.parametrize("gap_clip", [None, 1.0, 0.3])
def test_surrogate_matches_the_reference_values_and_gradient(gap_clip):
    g = torch.Generator().manual_seed(1)
    old = torch.log_softmax(torch.randn(5, 8, generator=g, dtype=torch.float64), -1)[:, :4]
    cur = (old + 0.4 * torch.randn(5, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    teacher = old + 2.0 * torch.randn(5, 4, generator=g, dtype=torch.float64)
    subset = torch.rand(5, 4, generator=g) < 0.7
    subset[4] = False  # an empty subset: no term
    per_token, metrics = topk_opd_per_token(
        cur, old, teacher, subset, gap_clip=gap_clip, clip_low=0.2, clip_high=0.28
    )
    want = _surrogate_reference(
        cur.tolist(), old.tolist(), teacher.tolist(), subset.tolist(), gap_clip, 0.2, 0.28
    )
    assert per_token.tolist() == pytest.approx(want, abs=1e-12)
    assert per_token[4].item() == 0.0
    assert 0 < float(metrics["clipfrac"]) < 1  # the ratio clip binds on some pairs
    per_token.sum().backward()
    eps = 1e-6  # central differences of the reference (piecewise smooth; no kink nearby)
    for n, k in [(0, 0), (1, 2), (2, 1), (3, 3)]:
        up, down = cur.detach().tolist(), cur.detach().tolist()
        up[n][k] += eps
        down[n][k] -= eps
        args = (old.tolist(), teacher.tolist(), subset.tolist(), gap_clip, 0.2, 0.28)
        num = (_surrogate_reference(up, *args)[n] - _surrogate_reference(down, *args)[n]) / (
            2 * eps
        )
        assert abs(cur.grad[n, k].item() - num) < 1e-7


def _batch(V: int):
    """Three samples: two candidates (hint lengths 3 and 2, so sorted 2 first), one candidate,
    and no hint at all."""
    g = torch.Generator().manual_seed(5)

    def ids(n):
        return torch.randint(3, V, (n,), generator=g).tolist()

    prompt, resp = [ids(4), ids(3), ids(5)], [ids(4), ids(5), ids(3)]
    hints = [[ids(3), ids(2)], [ids(4)], []]
    samples = []
    for p, r, hs in zip(prompt, resp, hints, strict=True):
        student = p + r
        mask = [False] * len(p) + [True] * len(r)

        def ctx(h, p=p, r=r):
            return p + h + r, [-1] * len(p) + [len(p) + len(h) + j for j in range(len(r))]

        cands = sorted([ctx(h) for h in hs], key=lambda c: len(c[0]))
        first = ctx(hs[0]) if hs else (None, [-1] * len(student))
        samples.append(
            TraceSample(
                student, mask, first[0], first[1], mask if hs else [False] * len(mask), None, cands
            )
        )
    return pack_samples(
        samples, rewards=[1.0, 0.0, 0.5], group_ids=[0, 0, 0], pad_id=0, max_response_length=5
    )


def _reference_loss(policy, rb, k, subset, selection, gap_clip, temperature):
    """Plain per-token loops over full-logit log-probs (independent of the chunked paths)."""
    s_lp = torch.log_softmax(full_logits(policy, rb.input_ids, rb.attention_mask) / temperature, -1)
    old_lp = s_lp.detach()
    B, C = rb.has_candidate.shape
    c_lp = [
        torch.log_softmax(
            full_logits(
                policy, rb.candidate_input_ids[:, c], rb.candidate_attention_mask[:, c]
            ).detach()
            / temperature,
            -1,
        )
        for c in range(C)
    ]

    def top(row):
        return sorted(range(len(row)), key=lambda v: (-row[v], v))[:k]

    terms = []
    for b in range(B):
        avail = [c for c in range(C) if rb.has_candidate[b, c]]
        if not avail:
            continue
        toks = [t for t in range(rb.input_ids.shape[1]) if rb.response_mask[b, t]]
        rows = {}
        for t in toks:
            o = old_lp[b, t - 1].tolist()
            cand = {c: c_lp[c][b, int(rb.candidate_positions[b, c, t]) - 1].tolist() for c in avail}
            rows[t] = (o, cand, {c: len(set(top(o)) & set(top(cand[c]))) for c in avail})
        if selection == "sequence_optimal":
            best = max(avail, key=lambda c: (sum(rows[t][2][c] for t in toks), -c))
        for t in toks:
            o, cand, ov = rows[t]
            c = (
                best
                if selection == "sequence_optimal"
                else avail[0]
                if selection == "shortest"
                else max(avail, key=lambda c: (ov[c], -c))
            )
            tc = cand[c]
            S = top(tc) if subset == "teacher" else top(o)
            if subset == "overlap":
                S = [v for v in S if v in set(top(tc))]
            if not S:
                continue
            z = sum(math.exp(o[v]) for v in S)
            total = 0.0
            for v in S:
                gap = tc[v] - o[v]
                if gap_clip is not None:
                    gap = max(-gap_clip, min(gap_clip, gap))
                a = (math.exp(o[v]) / z) * gap
                r = torch.exp(s_lp[b, t - 1, v] - o[v])
                total = total + torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
            terms.append(total)
    return torch.stack(terms).mean()


@pytest.mark.parametrize("subset", ["student", "teacher", "overlap"])
@pytest.mark.parametrize("selection", ["sequence_optimal", "token_optimal", "shortest"])
def test_head_equals_the_full_logit_reference(subset, selection):
    policy = tiny_model(seed=3)
    rb = _batch(64)
    assert rb.has_candidate.tolist() == [[True, True], [True, False], [False, False]]
    head = TopKOPDHead(k=4, subset=subset, selection=selection, gap_clip=0.5)
    module = ComposerModule(policy, [head], aggregation="token_mean", temperature=0.8, chunk_size=3)
    ctx = context(module, rb, set(head.requires))
    out = head.compute(rb, ctx)
    want = _reference_loss(policy, rb, 4, subset, selection, 0.5, 0.8)
    assert abs(out.loss.item() - want.item()) < 1e-10
    got = torch.autograd.grad(out.loss, list(policy.parameters()))
    ref = torch.autograd.grad(want, list(policy.parameters()))
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    assert out.metrics["tokens"] > 0


def test_head_arguments_are_checked():
    for kw, msg in [
        ({"k": 0}, "k must be an integer >= 1, got 0"),
        ({"subset": "both"}, "subset must be one of"),
        ({"selection": "longest"}, "selection must be one of"),
        ({"gap_clip": 0.0}, "gap_clip must be > 0 or None, got 0.0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            TopKOPDHead(**kw)


def _trained(subset: str, **micro) -> dict[str, torch.Tensor]:
    """Weights after one rollout batch with two updates (ppo_epochs = 2: the old top-k values
    are those before the first), SGD at lr 1."""
    import copy

    from torch.utils.data import DataLoader

    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from tests.helpers import quiet_trainer

    module = ComposerModule(
        copy.deepcopy(tiny_model(seed=3)),
        [DrGRPOHead(), TopKOPDHead(subset=subset, selection="token_optimal")],
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        aggregation="seq_mean_token_mean",
        ppo_epochs=2,
        max_grad_norm=None,
        max_logprob_gap=None,
        **micro,
    )
    quiet_trainer(max_steps=2).fit(
        module, train_dataloaders=DataLoader([_batch(64)], batch_size=None)
    )
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


@pytest.mark.parametrize("subset", ["teacher", "overlap"])
def test_micro_batches_give_the_unbatched_top_k_step(subset):
    want = _trained(subset)
    for micro in (dict(micro_batch_size=1), dict(max_tokens_per_micro_batch=20)):
        got = _trained(subset, **micro)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=1e-10, msg=f"{name} {micro}")
    assert not torch.equal(
        want["lm_head.weight"], tiny_model(seed=3).state_dict()["lm_head.weight"]
    )

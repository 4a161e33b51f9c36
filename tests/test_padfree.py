"""Padding-free forwards (`training/padfree.py`): the rows run as forwards of like length give
the padded forward's hidden states, and the padded step's loss and gradients (float64); the
groups are the cheapest cut, checked against every cut."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.training import hidden, padfree
from composer_lightning.training.hidden import final_hidden
from composer_lightning.training.microbatch import lengths
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer, tiny_model


def _cost(widths: list[int], groups: list[list[int]], forward_cost: int) -> int:
    return sum(len(g) * max(widths[r] for r in g) + forward_cost for g in groups)


def _cheapest(widths: list[int], forward_cost: int) -> int:
    """Every cut of the rows sorted longest first (2^(B-1) of them): the least cost."""
    order = sorted(range(len(widths)), key=lambda r: -widths[r])
    best = None
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for row, cut in zip(order[1:], cuts, strict=True):
            if cut:
                groups.append(current)
                current = []
            current.append(row)
        groups.append(current)
        cost = _cost(widths, groups, forward_cost)
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


def test_length_groups_by_hand():
    # equal rows: one forward
    assert padfree.length_groups([5, 5, 5]) == [[0, 1, 2]]
    # 10 and 1 tokens: padding 9 tokens is cheaper than a second forward of 64
    assert padfree.length_groups([1, 10], 64) == [[1, 0]]
    # 4 rows of 100 and 4 of 10: 800 + 64 as one forward, 400 + 40 + 128 = 568 as two
    widths = [10, 100, 10, 100, 100, 10, 10, 100]
    assert padfree.length_groups(widths, 64) == [[1, 3, 4, 7], [0, 2, 5, 6]]
    # free forwards: one per width; ties keep row order
    assert padfree.length_groups([3, 7, 3, 5], 0) == [[1], [3], [0, 2]]
    assert padfree.length_groups([]) == []
    with pytest.raises(ValueError, match="forward_cost must be >= 0 tokens, got -1"):
        padfree.length_groups([1, 2], -1)


def test_length_groups_are_the_cheapest_cut():
    """Random widths and costs: every row once, longest first, and the least cost of all
    2^(B-1) cuts of the sorted rows."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B = int(torch.randint(1, 10, (1,), generator=g))
        widths = torch.randint(1, 40, (B,), generator=g).tolist()
        cost = int(torch.randint(0, 80, (1,), generator=g))
        groups = padfree.length_groups(widths, cost)
        rows = [r for grp in groups for r in grp]
        assert sorted(rows) == list(range(B))
        assert [widths[r] for r in rows] == sorted(widths, reverse=True)
        assert _cost(widths, groups, cost) == _cheapest(widths, cost), (widths, cost)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 3 to 12 tokens, right-padded to 12, and one row of 12."""
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([3, 12, 7, 3, 9, 4, 12, 5])
    ids = torch.randint(0, 64, (8, 12), generator=g)
    attn = (torch.arange(12) < lens.unsqueeze(1)).long()
    return ids, attn


def test_grouped_forwards_give_the_padded_hidden_states(monkeypatch):
    """float64: every attended token's final hidden state equals one padded forward's (to
    1e-12), zeros past a row's last token; with free forwards one forward per length."""
    monkeypatch.setattr(padfree, "FORWARD_COST_TOKENS", 0)
    model = tiny_model(seed=1)
    ids, attn = _batch()
    calls: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    with padfree.padding_free(False):
        want, _ = final_hidden(model, ids, attn)
    assert calls == [(8, 12)]
    got, _ = final_hidden(model, ids, attn)
    assert sorted(calls[1:]) == sorted([(2, 12), (1, 9), (1, 7), (1, 5), (1, 4), (2, 3)])
    keep = attn.bool().unsqueeze(-1)
    torch.testing.assert_close(got * keep, want * keep, rtol=0, atol=1e-12)
    assert torch.equal(got[~attn.bool()], torch.zeros_like(got[~attn.bool()]))


def test_a_sharded_model_runs_one_forward(monkeypatch):
    """Under FSDP2 each forward is a collective: one forward whatever the lengths."""
    monkeypatch.setattr(padfree, "FORWARD_COST_TOKENS", 0)
    monkeypatch.setattr(hidden, "is_fsdp2", lambda model: True)
    model = tiny_model(seed=1)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    final_hidden(model, *_batch())
    assert calls == [1]


def _trained(padding_free: bool) -> tuple[dict[str, torch.Tensor], float]:
    """Weights and loss after one rollout batch of 2 minibatches (2 SGD steps at lr 1)."""
    torch.manual_seed(0)
    batch = synthetic_batch(
        torch.Generator().manual_seed(3), prompts=4, group_size=4, vocab_size=64
    )
    module = ComposerModule(
        copy.deepcopy(tiny_model(seed=1)),
        [
            DrGRPOHead(weight=1.0),
            OPDHead(weight=0.5),
            SDPOHead(weight=0.3),
            KLHead(kl_coef=0.2, estimator="k3", placement="loss", name="kl"),
        ],
        reference=copy.deepcopy(tiny_model(seed=2)),
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        variance_matching="dr_grpo",
        entropy_coef=0.05,
        minibatches=2,
        max_grad_norm=None,
        max_logprob_gap=None,
        padding_free=padding_free,
    )
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    loss = float(trainer.callback_metrics["train/loss"])
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}, loss


def test_a_padding_free_step_is_the_padded_step(monkeypatch):
    """Every forward of the step (policy, old, reference, hinted teacher) padding-free with a
    forward per length: the loss and the weights after two SGD steps at lr 1 (the gradients,
    exposed) equal the padded step's to 1e-10 in float64."""
    monkeypatch.setattr(padfree, "FORWARD_COST_TOKENS", 0)
    calls: list[int] = []
    forward = padfree.grouped_states

    def counted(fn, ids, attn):
        calls.append(len(padfree.length_groups(lengths(attn).tolist(), 0)))
        return forward(fn, ids, attn)

    monkeypatch.setattr(padfree, "grouped_states", counted)
    want, want_loss = _trained(False)
    assert calls == []
    got, loss = _trained(True)
    assert calls and max(calls) > 1  # the rows did run as several forwards
    assert loss == pytest.approx(want_loss, abs=1e-10)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-10, msg=name)
    start = tiny_model(seed=1).state_dict()
    assert any(not torch.equal(w, start[n]) for n, w in want.items())


def test_padding_free_must_be_a_bool():
    with pytest.raises(ValueError, match="padding_free must be true or false, got 'yes'"):
        ComposerModule(tiny_model(), [DrGRPOHead()], padding_free="yes")  # type: ignore[arg-type]

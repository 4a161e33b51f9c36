"""Each head's gradient at the final hidden states, its share, and gradient-norm matching
(`functional/gradients.py`, `Objective`), against independent autograd in float64."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.functional.gradients import hidden_gradients
from composer_lightning.heads.base import Head
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.protocols.step import StepContext
from composer_lightning.training.mixer import grad_norm_scales
from composer_lightning.training.module import ComposerModule
from composer_lightning.training.objective import Objective
from tests.helpers import Fixed, context, quiet_trainer, tiny_model

NAMES = ("dr_grpo", "opd", "sdpo", "kl", "replay_dpo")


def _heads() -> list[Head]:
    return [
        DrGRPOHead(weight=1.0),
        OPDHead(weight=0.5),
        SDPOHead(weight=0.3),
        KLHead(kl_coef=0.2, estimator="k3", placement="loss", name="kl"),
        ReplayDPOHead(weight=0.2, pairs_per_step=2),
    ]


def _module(**kwargs) -> ComposerModule:
    # the teacher cap measures every step a teacher head reads: off unless a test asks for it
    kwargs.setdefault("teacher_cap", None)
    return ComposerModule(
        tiny_model(seed=1),
        _heads(),
        reference=tiny_model(seed=2),
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        max_grad_norm=None,
        max_logprob_gap=None,
        **kwargs,
    )


def _batch():
    return synthetic_batch(torch.Generator().manual_seed(3), prompts=2, group_size=4, vocab_size=64)


def _ready(module: ComposerModule, batch) -> dict[str, float]:
    """Fill the replay buffer as a step does; the heads' weights at step 0."""
    ctx = context(module, batch)
    for head in module.heads:
        head.on_rollout(batch, ctx.old_logprobs)
    return module.objective.weights(0)


def _replayed(module: ComposerModule):
    """A function that puts the replay head's sampler back where it is now: every path below
    then draws the same pairs."""
    replay = next(h for h in module.heads if isinstance(h, ReplayDPOHead))
    state = replay.generator.get_state()
    return lambda: replay.generator.set_state(state)


def _surrogate(ctx: StepContext, adv, mask, lo=0.2, hi=0.28):
    """`token_sum_norm` of max(−r·A, −clip(r)·A), written out (not `policy_loss`)."""
    r = torch.exp(ctx.logprobs - ctx.old_logprobs)
    per = torch.maximum(-r * adv, -torch.clamp(r, 1 - lo, 1 + hi) * adv)
    return torch.where(mask, per, 0.0).sum() / (mask.shape[0] * ctx.norm_length)


def _flat(grads, at) -> torch.Tensor:
    """One gradient over several disjoint tensors: the concatenation (None: zeros)."""
    return torch.cat(
        [
            (torch.zeros_like(a) if g is None else g).flatten()
            for g, a in zip(grads, at, strict=True)
        ]
    )


def _by_hand(module: ComposerModule, batch, weights: dict[str, float]):
    """Each head's piece formed here (`w · loss`, or the surrogate of `w · A` alone) and its
    gradient at every policy forward's final hidden states by `torch.autograd.grad`."""
    ctx = context(module, batch)
    pieces = {}
    for head in module.heads:
        out, w = head.compute(batch, ctx), weights[head.name]
        if out.loss is not None:
            pieces[head.name] = w * out.loss
        else:
            pieces[head.name] = _surrogate(ctx, w * out.advantages, batch.response_mask)
    at = ctx.policy_states()
    grads = {}
    for name, piece in pieces.items():
        got = torch.autograd.grad(piece, at, retain_graph=True, allow_unused=True)
        grads[name] = _flat(got, at)
    return grads


def test_each_heads_gradient_at_the_hidden_states_is_its_own_piece_by_autograd():
    """Five heads on a tiny float64 model (replay DPO's gradient lies at its pairs' states):
    the objective's per-head gradients, and the logged `<head>/grad_norm` and `grad_share`,
    equal those of the pieces formed and differentiated by hand, to 1e-10."""
    module, batch = _module(), _batch()
    weights = _ready(module, batch)
    replay = _replayed(module)
    want = _by_hand(module, batch, weights)
    assert all(float(g.norm()) > 1e-6 for g in want.values())  # every head reaches the states

    replay()
    ctx, obj = context(module, batch), module.objective
    outputs = obj.head_outputs(batch, ctx, weights)
    got = hidden_gradients(obj.pieces(batch, ctx, outputs, weights), ctx.policy_states())
    for name in NAMES:
        flat = _flat(got[name], ctx.policy_states())
        torch.testing.assert_close(flat, want[name], rtol=0, atol=1e-10, msg=name)

    replay()
    _, metrics = obj(batch, context(module, batch), weights, measure_gradients=True)
    total = sum(want.values())
    for name in NAMES:
        assert metrics[f"{name}/grad_norm"] == pytest.approx(float(want[name].norm()), rel=1e-10)
        share = float(want[name] @ total / (total @ total))
        assert metrics[f"{name}/grad_share"] == pytest.approx(share, abs=1e-10)
    assert sum(metrics[f"{n}/grad_share"] for n in NAMES) == pytest.approx(1.0, abs=1e-12)


def test_the_pieces_decompose_the_mixed_objectives_gradient_on_policy():
    """One update of an on-policy batch (ratio 1: no clip binds), no entropy bonus: the
    objective's pieces' gradients sum to the gradient of the mixed objective itself, to
    1e-10."""
    module, batch = _module(), _batch()
    weights = _ready(module, batch)
    replay = _replayed(module)
    ctx, obj = context(module, batch), module.objective
    pieces = obj.pieces(batch, ctx, obj.head_outputs(batch, ctx, weights), weights)
    grads = hidden_gradients(pieces, ctx.policy_states())
    parts = {n: _flat(g, ctx.policy_states()) for n, g in grads.items()}
    replay()
    ctx = context(module, batch)
    loss, _ = obj(batch, ctx, weights)
    whole = _flat(torch.autograd.grad(loss, ctx.policy_states()), ctx.policy_states())
    torch.testing.assert_close(sum(parts.values()), whole, rtol=0, atol=1e-10)


def _linear_case(ratio_one: bool):
    """States h `[B, T, 4]` (a leaf) and log-probs `old + (h or h − h.detach()) @ v`: a ratio
    far from 1 (the clip binds) or exactly 1 with the same gradient; two advantage terms of
    opposite signs."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    batch = synthetic_batch(g, prompts=1, group_size=B, prompt_length=2, response_length=T - 2)
    batch.response_mask = torch.rand(B, T, generator=g) < 0.8
    h = torch.randn(B, T, 4, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(4, generator=g, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + ((h - h.detach()) if ratio_one else h) @ v
    ctx = StepContext(0, lp, old, "token_mean", T, 1.0, states=h)
    a1 = torch.randn(B, T, generator=g, dtype=torch.float64)
    a2 = -2.0 * a1 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return batch, ctx, [Fixed("one", a1), Fixed("two", a2, weight=0.5)]


@pytest.mark.parametrize(
    "mixing,ratio_one,exact",
    [("advantage", True, True), ("loss", False, True), ("advantage", False, False)],
)
def test_the_decomposition_is_exact_unless_a_clip_binds_under_advantage_mixing(
    mixing, ratio_one, exact
):
    """`mixing="loss"` sums exactly the pieces; `"advantage"` equals their sum wherever no
    clip binds (ratio 1), and differs where it binds on terms of opposite signs."""
    batch, ctx, heads = _linear_case(ratio_one)
    obj = Objective(heads, aggregation="token_mean", mixing=mixing)
    weights = {"one": 1.0, "two": 0.5}
    loss, metrics = obj(batch, ctx, weights, measure_gradients=True)
    (whole,) = torch.autograd.grad(loss, ctx.states, retain_graph=True)
    outputs = obj.head_outputs(batch, ctx, weights)
    grads = hidden_gradients(obj.pieces(batch, ctx, outputs, weights), [ctx.states])
    parts = grads["one"][0] + grads["two"][0]
    assert metrics["one/grad_share"] + metrics["two/grad_share"] == pytest.approx(1.0, abs=1e-12)
    if exact:
        torch.testing.assert_close(parts, whole, rtol=0, atol=1e-12)
    else:
        assert metrics["ppo/clipfrac"] > 0 and float((parts - whole).abs().max()) > 1e-3


def test_grad_norm_matching_gives_every_head_its_weights_share_of_the_reference_norm():
    """Matching to SDPO (a loss head, weight 0.3): the effective weights, used by an objective
    without matching, give head h the gradient norm (measured anew) `w_h / 0.3 · ‖g_sdpo‖`, so
    the weights stay ratios (equal weights: equal norms), and the same loss."""
    module, batch = _module(grad_norm_matching="sdpo"), _batch()
    weights = _ready(module, batch)
    replay = _replayed(module)
    loss, metrics = module.objective(batch, context(module, batch), weights)
    effective = {n: metrics[f"{n}/weight"] for n in NAMES}
    assert effective["sdpo"] == weights["sdpo"]
    assert all(abs(effective[n] / weights[n] - 1) > 1e-3 for n in NAMES if n != "sdpo")

    plain = Objective(module.heads, aggregation=module.objective.aggregation, teacher_cap=None)
    replay()
    unmatched = plain(batch, context(module, batch), weights, measure_gradients=True)[1]
    replay()
    again, measured = plain(batch, context(module, batch), effective, measure_gradients=True)
    ref = unmatched["sdpo/grad_norm"]
    for name in NAMES:
        want = weights[name] / weights["sdpo"] * ref
        assert measured[f"{name}/grad_norm"] == pytest.approx(want, rel=1e-10), name
        assert metrics[f"{name}/grad_norm"] == pytest.approx(want, rel=1e-10), name
    assert float(again.detach()) == pytest.approx(float(loss), abs=1e-12)


def test_a_head_or_reference_with_a_zero_gradient_keeps_its_weight():
    """Constant rewards: Dr. GRPO's advantages and gradient are 0, its weight stays; with it
    as the reference every weight stays."""
    assert grad_norm_scales({"a": 4.0, "b": 0.0, "c": 1.0}, "a") == {"a": 1.0, "b": 1.0, "c": 2.0}
    assert grad_norm_scales({"a": 0.0, "c": 1.0}, "a") == {"a": 1.0, "c": 1.0}
    batch = _batch()
    batch.rewards[:] = 1.0
    for reference, changed in (("opd", {"kl"}), ("dr_grpo", set())):
        module = ComposerModule(
            tiny_model(seed=1),
            [DrGRPOHead(weight=0.5), OPDHead(), KLHead(0.2, "k3", "loss", name="kl")],
            reference=tiny_model(seed=2),
            grad_norm_matching=reference,
        )
        weights = module.objective.weights(0)
        _, metrics = module.objective(batch, context(module, batch), weights)
        assert metrics["dr_grpo/grad_norm"] == 0.0
        for name, w in weights.items():
            assert (metrics[f"{name}/weight"] != w) == (name in changed), (reference, name)


class Recorder(Logger):
    """Every logged step's metrics as Python floats (`callback_metrics` are float32)."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple[int, dict[str, float]]] = []

    name = "recorder"
    version = 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.steps.append((step, dict(metrics)))


def _fit(batches: int, **kwargs) -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    module = _module(**kwargs)
    recorder = Recorder()
    trainer = quiet_trainer(max_steps=batches * module.minibatches, logger=recorder)
    trainer.log_every_n_steps = 1
    data = [_batch()] * batches
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))
    weights = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    return weights, recorder.steps


@pytest.mark.parametrize(
    "options",
    [
        dict(grad_share_every_n_steps=1),
        dict(grad_norm_matching="dr_grpo"),
        dict(teacher_cap=0.3),
    ],
    ids=["shares", "matching", "teacher_cap"],
)
def test_micro_batched_measurement_equals_the_unbatched_one(options):
    """Two minibatches, five heads, uneven rows; 1 or 3 rows or 30 tokens per forward: the
    logged norms, shares and (matched) weights and the weights after two SGD steps at lr 1
    equal the unbatched run's to 1e-10."""
    want_weights, want = _fit(1, minibatches=2, **options)
    keys = [k for k in want[0][1] if k.endswith(("/grad_norm", "/grad_share", "/weight"))]
    assert len([k for k in keys if k.endswith("/grad_share")]) == len(NAMES)
    for micro in (dict(micro_batch_size=1), dict(micro_batch_size=3)):
        got_weights, got = _fit(1, minibatches=2, **options, **micro)
        for key in keys:
            assert got[0][1][key] == pytest.approx(want[0][1][key], abs=1e-10), (key, micro)
        for name, w in want_weights.items():
            torch.testing.assert_close(got_weights[name], w, rtol=0, atol=1e-10, msg=name)


def test_shares_are_measured_every_n_steps_only():
    """Every 2 optimizer steps: logged at steps 0 and 2, not 1; off by default."""
    _, steps = _fit(3, grad_share_every_n_steps=2)
    logged = [any(k.endswith("/grad_share") for k in m) for _, m in steps]
    assert logged == [True, False, True]
    _, steps = _fit(1)
    assert not any(k.endswith(("/grad_share", "/grad_norm")) for k in steps[0][1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(variance_matching="dr_grpo", grad_norm_matching="dr_grpo"),
            "variance_matching and grad_norm_matching exclude each other",
        ),
        (dict(grad_norm_matching="nope"), "grad_norm_matching names head 'nope'"),
        (dict(grad_share_every_n_steps=-1), "grad_share_every_n_steps must be an integer >= 0"),
    ],
)
def test_bad_gradient_settings_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ComposerModule(tiny_model(), [DrGRPOHead()], **kwargs)


def test_a_step_context_without_states_says_why():
    ctx = StepContext(0, torch.zeros(1, 2), torch.zeros(1, 2), "token_mean", 2, 1.0)
    with pytest.raises(AttributeError, match="kept no policy hidden states"):
        ctx.policy_states()

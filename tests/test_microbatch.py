"""Micro-batches: the step's loss and gradients are exactly the unbatched ones (float64), for
every aggregation mode and head, with uneven lengths; the cut respects its budget."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.training.microbatch import MicroBatching, buckets, lengths
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer, tiny_model


def test_buckets_hold_every_row_once_within_the_budget():
    lens = torch.tensor([3, 9, 1, 7, 7, 2, 12, 5])
    parts = buckets(lens, max_tokens=16, max_samples=3)
    rows = sorted(torch.cat(parts).tolist())
    assert rows == list(range(8))
    for p in parts:
        assert len(p) <= 3
        assert len(p) * int(lens[p].max()) <= 16 or len(p) == 1  # a long row alone
    longest_first = [sorted(lens[p].tolist(), reverse=True) for p in parts]
    assert longest_first == [[12], [9], [7, 7], [5, 3, 2], [1]]  # 2 x 9 > 16; 3 rows at most
    assert [len(p) for p in buckets(lens, None, 3)] == [3, 3, 2]
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert lengths(mask).tolist() == [2, 4, 1]
    with pytest.raises(ValueError, match="max_tokens of a micro-batch must be an integer >= 1"):
        MicroBatching(max_tokens=0)


def _trained(aggregation: str, **micro) -> tuple[dict[str, torch.Tensor], float]:
    """Weights and last loss after one rollout batch of 2 minibatches (2 SGD steps, lr 1)."""
    torch.manual_seed(0)
    batch = synthetic_batch(
        torch.Generator().manual_seed(3), prompts=4, group_size=4, vocab_size=64
    )
    base = tiny_model(seed=1)
    module = ComposerModule(
        copy.deepcopy(base),
        [
            DrGRPOHead(weight=1.0),
            OPDHead(weight=0.5),
            SDPOHead(weight=0.3),
            KLHead(kl_coef=0.2, estimator="k3", placement="loss", name="kl"),
            ReplayDPOHead(weight=0.2, pairs_per_step=2),
        ],
        reference=copy.deepcopy(tiny_model(seed=2)),
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        aggregation=aggregation,
        variance_matching="dr_grpo",
        entropy_coef=0.05,
        minibatches=2,
        max_grad_norm=None,
        max_logprob_gap=None,
        **micro,
    )
    trainer = quiet_trainer(
        max_steps=2,
    )
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    loss = float(trainer.callback_metrics["train/loss"])
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}, loss


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]
)
def test_micro_batches_give_the_unbatched_loss_and_gradients(aggregation):
    """Rows of uneven lengths, 1 and 3 rows and a 30-token budget per forward, every head
    (group baselines, variance matching, SDPO's token mean, KL, replay DPO's pairs, entropy):
    the weights after two SGD steps at lr 1 (so gradients, exposed) and the loss equal the
    unbatched step's to 1e-10 in float64."""
    want, want_loss = _trained(aggregation)
    for micro in (
        dict(micro_batch_size=1),
        dict(micro_batch_size=3),
        dict(max_tokens_per_micro_batch=30),
    ):
        got, loss = _trained(aggregation, **micro)
        assert loss == pytest.approx(want_loss, abs=1e-10), micro
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=1e-10, msg=f"{name} {micro}")
        moved = [
            n for n, w in want.items() if not torch.equal(w, tiny_model(seed=1).state_dict()[n])
        ]
        assert moved  # the step changed the weights (a gradient reached them)


def test_micro_batches_under_ddp_are_one_configuration_line():
    """DDP's reducer is driven through `manual_backward`; the micro-batched backwards are not,
    so DDP with micro-batches is refused before anything runs."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from composer_lightning.runtime.errors import ConfigError
    from composer_lightning.runtime.inputs import check_trainer_options
    from tests.helpers import fit_trainer_stub

    def trainer(strategy):
        return fit_trainer_stub(strategy=strategy)

    with pytest.raises(ConfigError, match="not supported under DDPStrategy: use ModelParallel"):
        check_trainer_options(trainer(DDPStrategy(process_group_backend="gloo")), True)
    check_trainer_options(trainer(DDPStrategy(process_group_backend="gloo")), False)
    check_trainer_options(trainer(SingleDeviceStrategy("cpu")), True)

"""`model.ref_model_sync_steps`: the reference mixed toward the policy every N optimizer steps
as TRL's `SyncRefModelCallback` does, saved in checkpoints so a resume continues with it, and
refused in one line where there is nothing to sync."""

from __future__ import annotations

import glob

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule, synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.training.module import ComposerModule
from composer_lightning.training.refsync import mix_parameters_
from tests.helpers import quiet_trainer, tiny_model


def trl_sync_target_model(model, target_model, alpha):
    """TRL 1.16 `SyncRefModelCallback._sync_target_model` (trl/trainer/callbacks.py:130)."""
    for target_param, copy_param in zip(target_model.parameters(), model.parameters(), strict=True):
        target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)


def test_the_mix_equals_trls_and_a_hand_value():
    policy, ours, theirs = tiny_model(seed=0), tiny_model(seed=1), tiny_model(seed=1)
    mix_parameters_(ours, policy, 0.6)
    trl_sync_target_model(policy, theirs, 0.6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    ref, pol = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    ref.weight.data.fill_(1.0)
    pol.weight.data.fill_(3.0)
    mix_parameters_(ref, pol, 0.6)  # 0.4 * 1 + 0.6 * 3
    assert ref.weight.item() == pytest.approx(2.2, abs=1e-7)


class Snapshots(L.Callback):
    """The policy's and the reference's parameters after every training batch."""

    def __init__(self):
        self.policy, self.reference = [], []

    def on_train_batch_end(self, trainer, module, *args):
        self.policy.append([p.detach().clone() for p in module.policy.parameters()])
        self.reference.append([p.detach().clone() for p in module.reference.parameters()])


def _module(sync: int = 2) -> ComposerModule:
    return ComposerModule(
        tiny_model(torch.float64),
        [DrGRPOHead(), KLHead(0.1, "k3", "loss")],
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        max_logprob_gap=None,
        ref_model_sync_steps=sync,
        ref_model_mixup_alpha=0.6,
    )


class SameBatch(SyntheticRolloutDataModule):
    """One synthetic batch, every step: a resumed run sees what the whole run saw (the
    synthetic stream itself starts over on a resume)."""

    def train_dataloader(self):
        batch = synthetic_batch(torch.Generator().manual_seed(0), **self.kwargs)
        return DataLoader(_Repeat(batch), batch_size=None)


class _Repeat(IterableDataset):
    def __init__(self, batch):
        self.batch = batch

    def __iter__(self):
        while True:
            yield self.batch


def _fit(module, steps, callbacks=(), ckpt_path=None):
    trainer = quiet_trainer(max_steps=steps, callbacks=list(callbacks))
    trainer.fit(module, SameBatch(vocab_size=64), ckpt_path=ckpt_path)
    return trainer


def test_the_reference_is_mixed_after_every_second_step_and_only_then():
    module, snaps = _module(), Snapshots()
    start = [p.detach().clone() for p in module.reference.parameters()]
    _fit(module, 4, [snaps])
    refs = [start, *snaps.reference]
    for step in (1, 2, 3, 4):
        if step % 2:
            assert all(torch.equal(a, b) for a, b in zip(refs[step], refs[step - 1], strict=True))
            continue
        for ref, prev, pol in zip(refs[step], refs[step - 1], snaps.policy[step - 1], strict=True):
            assert torch.allclose(ref, 0.4 * prev + 0.6 * pol, atol=1e-15, rtol=0)
    assert not all(torch.equal(a, b) for a, b in zip(refs[4], start, strict=True))


def test_a_resumed_run_continues_with_the_synced_reference(tmp_path):
    """Checkpoint at step 2 (just synced), resume to 4: the same policy and reference as the
    run that never stopped. Without the reference in the checkpoint, the resumed run would
    take its KL against the configured one and end elsewhere."""
    whole = _module()
    _fit(whole, 4)
    first = _module()
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    _fit(first, 2, [saver])
    (ckpt,) = glob.glob(str(tmp_path / "*.ckpt"))
    assert any(
        k.startswith("reference.") for k in torch.load(ckpt, weights_only=False)["state_dict"]
    )
    resumed = _module()
    _fit(resumed, 4, ckpt_path=ckpt)
    for model in ("policy", "reference"):
        a, b = getattr(whole, model), getattr(resumed, model)
        for x, y in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.allclose(x, y, atol=1e-12, rtol=0), model


def test_a_fixed_reference_stays_out_of_the_checkpoint(tmp_path):
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)
    _fit(_module(sync=0), 1, [saver])
    (ckpt,) = glob.glob(str(tmp_path / "*.ckpt"))
    assert not any(
        k.startswith("reference.") for k in torch.load(ckpt, weights_only=False)["state_dict"]
    )


def test_nothing_to_sync_is_one_line():
    with pytest.raises(ValueError, match="needs a reference model, and no head with a non-zero"):
        ComposerModule(tiny_model(), [DrGRPOHead()], ref_model_sync_steps=4)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\], got 1.5"):
        ComposerModule(
            tiny_model(),
            [DrGRPOHead(), KLHead()],
            ref_model_sync_steps=4,
            ref_model_mixup_alpha=1.5,
        )
    from peft import LoraConfig

    with pytest.raises(
        ValueError, match="a LoRA policy's reference is the policy with its adapters off"
    ):
        ComposerModule(
            tiny_model(torch.float32),
            [DrGRPOHead(), KLHead()],
            peft=LoraConfig(r=2, target_modules=["q_proj"]),
            ref_model_sync_steps=4,
        )
    other = tiny_model(vocab_size=32)
    with pytest.raises(ValueError, match="model.reference's parameters differ from the policy's"):
        ComposerModule(
            tiny_model(), [DrGRPOHead(), KLHead()], reference=other, ref_model_sync_steps=4
        )

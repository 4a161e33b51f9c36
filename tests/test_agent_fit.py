"""Tool episodes through the whole loop: the tiny tool policy trains on multi-turn episodes,
validates on held-out episodes, and resumes exactly; unsupported combinations are one line."""

from __future__ import annotations

import itertools

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.models.tiny import tiny_tool_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.tasks import ToolErrorHint
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer

POLICY = tiny_tool_policy_path()


def _callback(**kwargs) -> RolloutCallback:
    # the tool configs' choice: a tool call has no score of its own, so the hint check cannot
    # tell whether the tool's error helps; the error is used unchecked
    kwargs.setdefault("hint_trust", "always")
    return RolloutCallback(
        HFEngine(model_path=POLICY, seed=0),
        group_size=2,
        sampling=SamplingConfig(temperature=0.7, max_tokens=32, seed=0),
        hint=ToolErrorHint(),
        max_turns=3,
        max_episode_tokens=192,
        samples_every_n_steps=0,
        val_samples=2,
        **kwargs,
    )


def _module() -> ComposerModule:
    return ComposerModule(
        POLICY,
        [DrGRPOHead(), OPDHead(gap_clip=1.0), SDPOHead()],
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )


def _data() -> RolloutDataModule:
    return RolloutDataModule(task="tool_calc", prompts_per_step=4, val_prompts=8)


class _Steps(L.Callback):
    """What each step's rollout batch held: turn rows, episodes, dispatch paths."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rb = batch.rollout
        self.seen.append((rb.batch_size, len(set(rb.episode_ids.tolist())), rb.has_teacher.sum()))


@pytest.mark.slow  # trains, validates and resumes tool episodes end to end
def test_tool_episodes_train_validate_and_resume_exactly(tmp_path):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1
    )
    steps = _Steps()
    whole = _module()
    trainer = quiet_trainer(
        max_steps=4, callbacks=[_callback(), ckpt, steps], val_check_interval=4,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(whole, _data())
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert 0 <= m["val/accuracy"] <= 1 and m["val/response_length"] > 10  # whole episodes
    assert m["episode/turns"] >= 1 and "episode/tool_errors" in m
    # turns are rows: more rows than episodes wherever an episode took several turns
    assert all(rows >= episodes for rows, episodes, _ in steps.seen)
    assert any(rows > episodes for rows, episodes, _ in steps.seen)
    assert sum(int(t) for *_, t in steps.seen) > 0  # tool errors became hints
    path = sorted(tmp_path.glob("*step=2*.ckpt"))[0]
    resumed = _module()
    again = quiet_trainer(max_steps=4, callbacks=[_callback()], limit_val_batches=0)
    again.fit(resumed, _data(), ckpt_path=str(path))
    for (name, a), b in zip(
        whole.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name  # episodes 3 and 4 replayed exactly


class _Recording(HFEngine):
    """An HF engine that records each sampled call's seed range `[seed, seed + prompts * n)`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ranges = []

    def generate(self, prompts, n, sampling):
        if sampling.temperature > 0 and prompts:
            self.ranges.append((sampling.seed, sampling.seed + len(prompts) * n))
        return super().generate(prompts, n, sampling)


def test_held_out_episodes_never_reuse_a_seed_across_batches_or_turns():
    """Each held-out batch reserves a seed range per turn: batch b's turn 1 does not sample
    with batch b + 1's turn 0 seeds."""
    cb = _callback()
    cb.engine = _Recording(model_path=POLICY, seed=0)
    trainer = quiet_trainer(callbacks=[cb])
    trainer.validate(
        _module(), RolloutDataModule(task="tool_calc", prompts_per_step=2, val_prompts=6)
    )
    ranges = sorted(cb.engine.ranges)
    assert len(ranges) > 3  # three held-out batches, some of them with later turns
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert start >= end, ranges

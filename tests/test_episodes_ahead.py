"""Multi-turn episodes generated ahead of the trainer (`max_turns > 1` with `max_staleness` k >
0): every turn of batch m sampled at version m − k with the on-policy seeds, the environment
stepped while the trainer updates, the correction and canary at the batch's version, and the
episodes generated ahead kept in checkpoints so a resume is the uninterrupted run."""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.models.tiny import tiny_tool_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.tasks.tool_calc import ToolCalc
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer
from tests.test_agent_fit import _callback as agent_callback

pytestmark = pytest.mark.slow  # episodes generated ahead, trained end to end

POLICY = tiny_tool_policy_path()


class CountingToolCalc(ToolCalc):
    """`tool_calc` whose environments record the problem of each step (any batch's, any
    thread's)."""

    name = "counting_tool_calc"
    stepped_on: list[str] = []
    stepped = threading.Condition()

    def environment(self, problem):
        env = super().environment(problem)
        step = env.step

        def counted(message):
            out = step(message)
            with CountingToolCalc.stepped:
                CountingToolCalc.stepped_on.append(_question(problem))
                CountingToolCalc.stepped.notify_all()
            return out

        env.step = counted
        return env


def _question(problem) -> str:
    return str(problem.get("prompt") or problem.get("messages"))


def _callback(k: int) -> RolloutCallback:
    """The tool agent's callback of `tests/test_agent_fit.py`, generating `k` batches ahead."""
    return agent_callback(max_staleness=k)


def _module(lr: float = 1e-3) -> ComposerModule:
    return ComposerModule(
        POLICY,
        [DrGRPOHead(), OPDHead(gap_clip=1.0)],
        optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
    )


def _data(task: str = "tool_calc") -> RolloutDataModule:
    return RolloutDataModule(task=task, prompts_per_step=4, val_prompts=4)


class _Batches(L.Callback):
    """Each step's rollout rows and metrics."""

    def __init__(self):
        self.rows, self.metrics = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rb = batch.rollout
        self.rows.append(
            (rb.input_ids.tolist(), rb.response_mask.tolist(), rb.engine_logprobs.clone())
        )

    def on_train_batch_end(self, trainer, *args):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_validation_end(self, trainer, pl_module):
        self.val = {k: float(v) for k, v in trainer.callback_metrics.items()}


def _fit(k, steps, lr=1e-3, callbacks=(), data=None, ckpt_path=None, **trainer_kw):
    seen = _Batches()
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=[_callback(k), seen, *callbacks],
        **({"limit_val_batches": 0} | trainer_kw),
    )
    module = _module(lr)
    trainer.fit(module, data or _data(), ckpt_path=ckpt_path)
    return module, seen


def test_with_weights_that_never_change_episodes_ahead_are_the_on_policy_ones():
    """lr = 0: every version has the same weights, so generating ahead may change nothing:
    the same turns, token for token, as on policy (the seeds of each turn are kept)."""
    _, on_policy = _fit(0, 4, lr=0.0)
    _, ahead = _fit(2, 4, lr=0.0)
    assert [m["rollout/staleness"] for m in ahead.metrics] == [0, 1, 2, 2]
    for step, (a, b) in enumerate(zip(on_policy.rows, ahead.rows, strict=True)):
        assert a[0] == b[0] and a[1] == b[1], step  # every turn's ids and what is trained on
        assert torch.allclose(a[2], b[2], atol=1e-5), step


def test_stale_episodes_are_corrected_and_checked_at_their_version():
    module, seen = _fit(1, 4, val_check_interval=4, limit_val_batches=1)
    assert module.policy_version == 4
    rows = seen.metrics
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert "ppo/is_weight_mean" not in rows[0]  # batch 0 is on policy
    for r in rows[1:]:
        assert 0 < r["ppo/is_weight_mean"] <= 2.0 and r["episode/turns"] >= 1
    # the canary recomputes a stale batch's turns at their version: healthy is ≈ 1e-6
    assert max(r["rollout/logprob_gap_max"] for r in rows) < 1e-5
    assert 0 <= seen.val["val/accuracy"] <= 1  # held-out episodes through the engine process


class _WaitForOtherEpisodes(L.Callback):
    """At step 0, after its batch was taken and before the update: waits (at most `timeout`
    seconds) until an environment of another batch's problem has been stepped. Only episodes
    generated ahead, beside the trainer, can have stepped one by then."""

    def __init__(self, timeout: float):
        self.timeout, self.stepped_meanwhile = timeout, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step:
            return
        mine = {_question(p) for p in batch.problems}
        with CountingToolCalc.stepped:
            self.stepped_meanwhile = CountingToolCalc.stepped.wait_for(
                lambda: any(q not in mine for q in CountingToolCalc.stepped_on),
                timeout=self.timeout,
            )


@pytest.mark.parametrize("k", [0, 1])
def test_the_environment_is_stepped_while_the_trainer_updates(k):
    """On policy nothing can step an environment during the update, however long one waits
    (10 s); ahead, batch 1's episodes do (a hang fails at 300 s)."""
    CountingToolCalc.stepped_on.clear()
    waiter = _WaitForOtherEpisodes(timeout=300 if k else 10)
    _fit(k, 2, callbacks=[waiter], data=_data(f"{__name__}.CountingToolCalc"))
    assert waiter.stepped_meanwhile is (k > 0)


def test_episodes_generated_ahead_are_in_the_checkpoint_and_a_resume_is_the_whole_run(tmp_path):
    """k = 2: the step-2 checkpoint holds batches 2 and 3 (versions 0 and 1) as episodes; the
    resumed run trains on them (its engine process never had those versions) and ends with the
    uninterrupted run's weights, bit for bit."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1
    )
    whole, _ = _fit(2, 4, callbacks=[ckpt])
    path = sorted(tmp_path.glob("*step=2*.ckpt"))[0]
    saved = torch.load(path, map_location="cpu", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if "RolloutCallback" in k]
    (mine,) = state["pending"]
    batches = mine["batches"]
    assert sorted(batches) == [2, 3] and [batches[i][0] for i in (2, 3)] == [0, 1]
    assert all(isinstance(batches[i][1], dict) and batches[i][1]["episodes"] for i in (2, 3))
    resumed, seen = _fit(2, 4, ckpt_path=str(path))
    assert [m["rollout/staleness"] for m in seen.metrics] == [2, 2]
    for (name, a), b in zip(
        whole.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tensor_parallel_episodes_are_one_line_saying_why():
    cb = _callback(0)
    with pytest.raises(ConfigError, match="episodes end at different turns on different ranks"):
        from composer_lightning.rollout.checks import check_engine_layout

        check_engine_layout(2, 2, cb.episodes.max_turns, 0)

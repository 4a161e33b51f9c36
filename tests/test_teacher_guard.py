"""The teacher guard (`rollout/teacher_guard.py`): the teacher heads go off once the student's
greedy accuracy falls beyond noise below its step-0 figure while they act; every rank decides
the same from reduced figures, and a resumed run decides as the uninterrupted one."""

from __future__ import annotations

import io
import math
from fractions import Fraction

import lightning as L
import pytest
import torch

from composer_lightning.rollout.teacher_guard import StepFigures, TeacherGuard, drop_z


def _step(right: float, checked: float = 8.0, teacher: float = 20.0, rows: float = 32.0):
    """One step's reduced figures as the rollout logs them."""
    return {
        "hint/checked": checked,
        "hint/student_accuracy": right / checked,
        "dispatch/opd_rl": teacher,
        "dispatch/opd_only": 0.0,
        "dispatch/rl_only": rows - teacher,
    }


def test_the_drop_is_a_pooled_two_proportion_z():
    # by hand: p0 = 18/72, p = 2/32, pooled 20/104
    pool = Fraction(20, 104)
    var = pool * (1 - pool) * (Fraction(1, 72) + Fraction(1, 32))
    want = float(Fraction(18, 72) - Fraction(2, 32)) / math.sqrt(float(var))
    assert drop_z((18.0, 72.0), (2.0, 32.0)) == pytest.approx(want, abs=1e-12)
    assert want == pytest.approx(2.2392, abs=1e-4)
    assert drop_z((2.0, 32.0), (18.0, 72.0)) == pytest.approx(-want, abs=1e-12)  # a rise
    assert drop_z((0.0, 8.0), (0.0, 32.0)) is None  # no variance: nothing to judge
    assert drop_z((18.0, 0.0), (2.0, 32.0)) is None
    assert drop_z((30.0, 8.0), (2.0, 32.0)) is None  # a mean outside [0, 1]: not a proportion


def test_the_figures_come_from_the_check_and_the_dispatch():
    f = StepFigures.of(_step(3.0, teacher=12.0) | {"dispatch/opd_only": 4.0})
    assert f == StepFigures(score=3.0, checked=8.0, teacher_rows=16.0, rows=36.0)
    assert StepFigures.of({"dispatch/opd_rl": 3.0}) is None  # no check this step
    # context distillation's hinted replies are the teacher's samples too
    cd = StepFigures.of(_step(3.0, teacher=0.0) | {"hinted/replies": 8.0})
    assert cd == StepFigures(score=3.0, checked=8.0, teacher_rows=8.0, rows=40.0)


def test_a_fall_while_the_teacher_acts_stops_it_after_a_full_window():
    guard = TeacherGuard(window=4, z=2.0, min_share=0.1)
    assert guard.observe(0, _step(3.0), heldout=(15.0, 64.0)) is None
    assert guard.base == (18.0, 72.0) and guard.base_step == 0  # the check and held-out, pooled
    for step in (1, 2, 3):  # no full window yet, whatever the accuracy
        assert guard.observe(step, _step(0.0)) is None
    line = guard.observe(4, _step(0.0))
    # steps 1-4: 0 of 32 against 18 of 72: z = 0.25 / sqrt(pool (1 - pool) (1/72 + 1/32))
    pool = 18 / 104
    z = 0.25 / math.sqrt(pool * (1 - pool) * (1 / 72 + 1 / 32))
    assert guard.off and guard.off_from == 5
    assert line is not None and "off from step 5" in line and "steps 1-4 is 0.000" in line
    assert f"{z:.1f} standard errors below its 0.250" in line and "72 problems" in line
    assert "62% of the samples" in line and "teacher_guard: false" in line
    assert guard.observe(5, _step(0.0)) is None and guard.off_from == 5  # said once


def test_no_stop_without_a_fall_or_without_the_teacher():
    def run(guard, series, share_teacher=20.0):
        out = [guard.observe(0, _step(3.0, teacher=share_teacher), heldout=(15.0, 64.0))]
        out += [guard.observe(s, _step(r, teacher=share_teacher)) for s, r in series]
        return out

    steady = TeacherGuard()
    assert not any(run(steady, [(s, 2.0) for s in range(1, 12)])) and not steady.off
    rising = TeacherGuard()
    assert not any(run(rising, [(s, 6.0) for s in range(1, 12)])) and not rising.off
    # the same fall as above, with the teacher on 3 of 32 samples (< 10 %): not its doing
    idle = TeacherGuard()
    assert not any(run(idle, [(s, 0.0) for s in range(1, 12)], share_teacher=3.0))
    # inside noise: 4 of 32 against 3 of 8 alone (no held-out set) is z 1.66
    small = TeacherGuard()
    small.observe(0, _step(3.0))
    assert all(small.observe(s, _step(1.0)) is None for s in range(1, 9)) and not small.off
    assert drop_z((3.0, 8.0), (4.0, 32.0)) == pytest.approx(1.664, abs=1e-3)


def test_the_teachers_share_is_over_the_steps_before_the_window():
    guard = TeacherGuard(window=2, z=2.0, min_share=0.5)
    guard.observe(0, _step(8.0, teacher=0.0), heldout=(64.0 * 0.75, 64.0))
    guard.observe(1, _step(0.0, teacher=0.0))
    # window steps 1-2 fell; the teacher acted only at step 2, after the updates they follow
    assert guard.observe(2, _step(0.0, teacher=32.0)) is None
    z, acc, share = guard.verdict(2)
    assert z is not None and z > 2 and acc == 0.0 and share == 0.0
    # at step 3, steps 1-2 had the teacher on 32 of 64 samples: a half, enough
    assert guard.observe(3, _step(0.0, teacher=0.0)) is not None and guard.off_from == 4


def test_scores_of_another_scale_never_stop_the_teacher():
    guard = TeacherGuard()
    guard.observe(0, _step(30.0), heldout=(0.0, 0.0))  # mean 3.75: not a proportion
    assert all(guard.observe(s, _step(-8.0)) is None for s in range(1, 10)) and not guard.off


def test_a_resumed_guard_decides_as_the_uninterrupted_one():
    series = [3.0, 1.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    whole = TeacherGuard()
    said = [
        whole.observe(s, _step(r), heldout=(15.0, 64.0) if s == 0 else (0.0, 0.0))
        for s, r in enumerate(series)
    ]
    assert whole.off, said
    for cut in range(1, len(series)):
        first = TeacherGuard()
        for s, r in enumerate(series[:cut]):
            first.observe(s, _step(r), heldout=(15.0, 64.0) if s == 0 else (0.0, 0.0))
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)  # as the checkpoint keeps it
        buffer.seek(0)
        resumed = TeacherGuard()
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        rest = [resumed.observe(s, _step(r)) for s, r in enumerate(series) if s >= cut]
        assert rest == said[cut:], cut
        assert resumed.off_from == whole.off_from and resumed.base == whole.base


# ---------------------------------------------------------------- in a run
class _Record(L.Callback):
    """Each step's rollout metrics, after the rollout callback made them."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.steps.append(batch.rollout.metrics.local())


def test_a_stopped_teacher_leaves_the_run_rl_alone_and_says_so(capsys):
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import HFEngine
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.opd import OPDHead
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.tasks import VerifierHint
    from composer_lightning.training.module import ComposerModule
    from tests.helpers import quiet_trainer

    policy = tiny_policy_path()
    cb = RolloutCallback(
        HFEngine(model_path=policy, seed=0),
        group_size=2,
        hint=VerifierHint(),
        hint_trust="always",
        teacher_replies="all",
    )
    # a student that was right on every problem before (a baseline of 8 of 8) and a window of
    # one step: the tiny model's wrong step-0 replies are a fall, the teacher acted (share 0 ok)
    assert cb._guard is not None
    cb._guard = TeacherGuard(window=1, z=2.0, min_share=0.0, base=(8.0, 8.0), base_step=-1)
    record = _Record()
    module = ComposerModule(
        policy, [DrGRPOHead(), OPDHead()], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)
    )
    dm = RolloutDataModule(tokenizer=policy, prompts_per_step=4)
    trainer = quiet_trainer(max_steps=3, callbacks=[cb, record], limit_val_batches=0)
    trainer.fit(module, dm)
    out = capsys.readouterr().out
    assert out.count("teacher guard: the teacher heads are off from step 1") == 1
    first, *after = record.steps
    assert first["hint/student_accuracy"] < 1.0 and first["hint/teacher_off"] == 0.0
    assert first["dispatch/opd_rl"] + first["dispatch/opd_only"] > 0  # the teacher acted
    for m in after:  # RL alone, the check still measured and logged
        assert m["dispatch/opd_rl"] == m["dispatch/opd_only"] == 0.0
        assert m["hint/teacher_off"] == 1.0 and m["hint/checked"] > 0
    state = cb.state_dict()["teacher_guard"]
    assert state["off_from"] == 1
    again = RolloutCallback(HFEngine(model_path=policy, seed=0), group_size=2)
    again.load_state_dict(cb.state_dict())
    assert again._guard is not None and again._guard.off_from == 1  # a resume keeps it off
    off = RolloutCallback(HFEngine(model_path=policy, seed=0), group_size=2, teacher_guard=False)
    assert "teacher_guard" not in off.state_dict()
    off.load_state_dict(cb.state_dict())  # a guard's state, ignored where it is off
    with pytest.raises(ValueError, match="teacher_guard must be true or false, got 'yes'"):
        RolloutCallback(HFEngine(model_path=policy, seed=0), teacher_guard="yes")


def test_the_baseline_step_is_never_in_the_window():
    guard = TeacherGuard(window=4)
    guard.observe(5, _step(3.0), heldout=(15.0, 64.0))  # the first check this guard sees
    assert guard.base_step == 5
    assert [guard.observe(s, _step(0.0)) for s in (6, 7, 8)] == [None] * 3
    assert guard.verdict(8)[0] is None  # steps 6-8: not yet a full window
    assert guard.observe(9, _step(0.0)) is not None and guard.off_from == 10


def test_a_stopped_teacher_leaves_context_distillation_nothing_to_imitate(capsys):
    """Context distillation's hinted replies are the teacher's samples: they count toward its
    share, and once the guard stops the teacher none is sampled, so the head imitates
    nothing and the run is RL alone."""
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import HFEngine
    from composer_lightning.heads.context_distill import ContextDistillHead
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.rollout.hinted import HintedReplies
    from composer_lightning.tasks import AnswerHint
    from composer_lightning.training.module import ComposerModule
    from tests.helpers import quiet_trainer

    policy = tiny_policy_path()
    cb = RolloutCallback(
        HFEngine(model_path=policy, seed=0),
        group_size=2,
        hint=AnswerHint(),
        hinted_replies=HintedReplies(source="hint"),  # the hint's own text: never truncated
    )
    # as above, a baseline of 8 of 8 and a window of one step; the share of at least a tenth
    # (over the step before the window) is met only if the hinted replies count
    cb._guard = TeacherGuard(window=1, z=2.0, min_share=0.1, base=(8.0, 8.0), base_step=-1)
    record = _Record()
    module = ComposerModule(
        policy,
        [DrGRPOHead(), ContextDistillHead(min_reward=None)],
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    dm = RolloutDataModule(tokenizer=policy, prompts_per_step=4)
    trainer = quiet_trainer(max_steps=4, callbacks=[cb, record], limit_val_batches=0)
    trainer.fit(module, dm)
    off = cb._guard.off_from
    assert off is not None and 2 <= off <= 3, off  # not at step 0: no step before it yet
    said = capsys.readouterr().out
    assert said.count(f"teacher guard: the teacher heads are off from step {off}") == 1
    for m in record.steps[:off]:
        assert m["hinted/replies"] > 0 and m["hint/teacher_off"] == 0.0
        assert StepFigures.of(m).teacher_rows == m["hinted/replies"]  # type: ignore[union-attr]
    for m in record.steps[off:]:  # no hinted reply: context distillation imitates nothing
        assert m.get("hinted/replies", 0.0) == 0.0 and m["hint/teacher_off"] == 1.0
        assert m["hint/checked"] > 0  # the check still measures

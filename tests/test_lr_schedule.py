"""`WarmupDecayLR` sets the same lr as transformers' own schedules (TRL's `lr_scheduler_type`) at
every optimizer step, survives a checkpoint round trip, and refuses bad settings by name."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import get_scheduler

from composer_lightning.training.lr_schedule import WarmupDecayLR

TOTAL = 10


def _lrs(make, steps: int = TOTAL + 2) -> list[float]:
    """The lr of each of `steps` optimizer steps under the scheduler `make(optimizer)`."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    ("name", "warmup", "kwargs", "ours"),
    [
        ("linear", 0, {}, {"decay": "linear"}),
        ("linear", 3, {}, {"decay": "linear"}),
        ("cosine", 2, {}, {"decay": "cosine"}),
        ("cosine_with_min_lr", 2, {"min_lr_rate": 0.1}, {"decay": "cosine", "min_lr_rate": 0.1}),
        ("constant_with_warmup", 3, {}, {"decay": "constant"}),
        ("constant", 0, {}, {"decay": "constant"}),
    ],
)
def test_every_step_matches_transformers(name, warmup, kwargs, ours):
    """transformers' factor at step s (its `get_scheduler`, as TRL's Trainer builds it) equals
    ours up to `total_steps`; e.g. linear with 3 warmup steps: 0, 1/3, 2/3, then (10 − s) / 7."""
    theirs = _lrs(
        lambda opt: get_scheduler(
            name, opt, num_warmup_steps=warmup, num_training_steps=TOTAL,
            scheduler_specific_kwargs=kwargs,
        )
    )  # fmt: skip
    mine = _lrs(lambda opt: WarmupDecayLR(opt, total_steps=TOTAL, warmup_steps=warmup, **ours))
    assert mine[: TOTAL + 1] == pytest.approx(theirs[: TOTAL + 1], rel=1e-12, abs=1e-15)
    if name == "linear" and warmup == 3:
        assert mine[:5] == pytest.approx([0.0, 0.5 / 3, 1.0 / 3, 0.5, 0.5 * 6 / 7])
    assert mine[TOTAL + 1] == mine[TOTAL]  # past the end it stays at its end value


def test_a_restored_schedule_continues_where_it_stopped():
    """The state is plain numbers (no lambda): saved after 4 steps and loaded into a fresh
    scheduler, the next lrs are those of the uninterrupted run."""
    whole = _lrs(lambda opt: WarmupDecayLR(opt, total_steps=TOTAL, warmup_steps=2, decay="cosine"))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = WarmupDecayLR(opt, total_steps=TOTAL, warmup_steps=2, decay="cosine")
    for _ in range(4):
        opt.step()
        sched.step()
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched2 = WarmupDecayLR(opt2, total_steps=TOTAL, warmup_steps=2, decay="cosine")
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    rest = []
    for _ in range(TOTAL + 2 - 4):
        rest.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert rest == pytest.approx(whole[4:], rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_steps": 0}, "total_steps must be an integer > 0, got 0"),
        ({"total_steps": 5, "warmup_steps": 6}, "warmup_steps must be an integer in [0, total_steps = 5], got 6"),
        ({"total_steps": 5, "decay": "poly"}, "decay 'poly'; expected one of ('linear', 'cosine', 'constant')"),
        ({"total_steps": 5, "min_lr_rate": 1.0}, "min_lr_rate must be in [0, 1), got 1.0"),
    ],
)  # fmt: skip
def test_bad_settings_are_named(kwargs, message):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    with pytest.raises(ValueError) as info:
        WarmupDecayLR(opt, **kwargs)
    assert message in str(info.value)

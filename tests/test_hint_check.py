"""The hint check (`rollout/hint_check.py`): the teacher heads read a hint only in the groups
whose hinted teacher knows better; the step-0 line says whether the hint helps; the placebo
gives every hinted turn another problem's hint; by default the teacher acts only on the replies
below the hinted teacher's own reply."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import AutoTokenizer

from composer_lightning.chat import single_turn_teacher, tokenize_prompt
from composer_lightning.engines.base import SamplingConfig
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.rollout.dispatch import RolloutPlan, build_rollout
from composer_lightning.rollout.episodes import one_turn_episodes
from composer_lightning.rollout.hint_check import (
    HintCheck,
    below_mean_rows,
    hint_line,
    placebo_hints,
    teacher_bars,
)
from composer_lightning.tasks import VerifierScore
from tests.test_hinted_replies import _Engine, _Hint, _reply


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_policy_path())


# ---------------------------------------------------------------- the placebo
def test_placebo_gives_every_hinted_turn_a_hint_of_another_group():
    hints = ["a0", None, "a1", "b0", "c0", None, "c1", ["d0", "d0'"]]
    groups = [0, 0, 0, 1, 2, 2, 2, 3]
    out = placebo_hints(hints, groups, seed=7)
    assert [h is None for h in out] == [h is None for h in hints]  # who has a hint, kept
    own = {0: {"a0", "a1"}, 1: {"b0"}, 2: {"c0", "c1"}, 3: {"d0"}}
    donors = {}
    for h, g in zip(out, groups, strict=True):
        if h is None:
            continue
        first = h[0] if isinstance(h, list) else h
        (donor,) = [d for d, given in own.items() if first in given]
        assert donor != g  # never its own problem's hint
        donors.setdefault(g, set()).add(donor)
    assert all(len(d) == 1 for d in donors.values())  # one donor per group
    assert sorted(d for (d,) in donors.values()) == [0, 1, 2, 3]  # a permutation: a cycle
    assert out[0] != out[2] or len(own[next(iter(donors[0]))]) == 1  # the donor's k-th hint
    assert placebo_hints(hints, groups, seed=7) == out  # seeded
    assert any(placebo_hints(hints, groups, seed=s) != out for s in range(8))


def test_placebo_with_one_hinted_group_has_no_other_problem():
    assert placebo_hints(["a", None, "b"], [4, 4, 4], seed=0) == [None, None, None]


# ---------------------------------------------------------------- the replies below the mean
def test_the_teacher_keeps_only_the_replies_below_their_groups_mean():
    """Hand-derived: group 0 (1, 0, 0, 1; mean 0.5) keeps its two wrong replies; group 1 (all
    0.1: a mean that rounds above 0.1 in floats) keeps none; group 2 keeps the 0.2 below its
    mean 0.6 and the unrewarded row (its only signal) but not the unhinted one; group 3 (-1, 0)
    keeps the -1 (a truncation penalty)."""
    hints = ["h"] * 4 + ["h"] * 3 + ["h", None, "h", "h"] + ["h", "h"]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.2, 0.9, 1.0, None, -1.0, 0.0]
    groups = [0] * 4 + [1] * 3 + [2] * 4 + [3] * 2
    assert sum(rewards[4:7]) / 3 > 0.1  # the float trap the tolerance covers
    kept, metrics = below_mean_rows(hints, rewards, groups)
    assert kept == [None, "h", "h", None] + [None] * 3 + ["h", None, None, "h"] + ["h", None]
    assert metrics.local()["hint/teacher_fraction"] == pytest.approx(5 / 12)
    assert below_mean_rows([None, None], [0.0, 1.0], [0, 0])[0] == [None, None]


def test_a_turn_with_a_next_state_keeps_its_hint_and_is_not_in_the_mean():
    """Two episodes of one problem, each a tool turn (its episode's outcome, not judged) then a
    last turn: outcomes 1 and 0. Only the failed episode's last turn is below the mean (0.5 over
    the two last turns, not over all four rows); both tool turns keep their error hints, the
    successful episode's too (the teacher is a tool turn's only per-turn signal). A turn with a
    score of its own (judged, 0.2) joins the baseline: the mean is 0.4 and 0.2 is below it."""
    hints = ["tool error", "h", "tool error", "h"]
    rewards = [1.0, 1.0, 0.0, 0.0]
    judged = [False, True, False, True]
    kept, _ = below_mean_rows(hints, rewards, [0] * 4, judged)
    assert kept == ["tool error", None, "tool error", "h"]
    kept, _ = below_mean_rows(["h"] * 3, [1.0, 0.0, 0.2], [0] * 3, [True] * 3)
    assert kept == [None, "h", "h"]
    # episodes of 3, 1 and 1 turns (outcomes 0.6, 0.5, 0.3): the baseline is 1.4 / 3 over the
    # last turns; over every row it would be 2.6 / 5 = 0.52 and would keep the 0.5 episode's
    kept, _ = below_mean_rows(
        [None, None, "h", "h", "h"],
        [0.6, 0.6, 0.6, 0.5, 0.3],
        [0] * 5,
        [False, False, True, True, True],
    )
    assert kept == [None, None, None, None, "h"]


def test_below_the_mean_the_teacher_has_only_the_replies_below_the_mean(tokenizer):
    """Group 0 has one right reply of two: only the wrong one reads the teacher; group 1 is
    all wrong (Dr. GRPO has no signal there) and reads none; with "all" every hinted reply
    does (the test's hint provider hints the wrong replies only)."""
    from composer_lightning.rollout.callback import RolloutCallback

    assert RolloutCallback(engine=None).teacher_replies == "below_teacher"
    with pytest.raises(ValueError, match=r"teacher_replies must be one of .*got 'wrong'"):
        RolloutCallback(engine=None, teacher_replies="wrong")
    problems = PROBLEMS[:2]
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[_reply(tokenizer, "2"), _reply(tokenizer, "9")], [_reply(tokenizer, "9")] * 2]
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    plan = RolloutPlan(tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="user")
    for replies, teacher in (
        ("below_mean", [False, True, False, False]),
        ("all", [False, True, True, True]),
    ):
        rollout, metrics, _ = build_rollout(batch, episodes, replace(plan, teacher_replies=replies))
        assert rollout.has_teacher.tolist() == teacher
        assert rollout.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]  # every reply still an RL sample
    assert metrics.local()["dispatch/opd_rl"] == 3


def test_below_the_teacher_a_group_in_bars_compares_with_its_teachers_score():
    """Hand-derived: group 0 (1, 0; bar 1) keeps the 0, as below the mean; group 1 (all 0, bar
    1: all wrong, the teacher right) keeps both, where below the mean keeps none; group 2 (all
    1, bar 1) keeps none; group 3 (0.2, 0.6, bar 0.5) keeps the 0.2 (below its mean 0.4 too);
    group 4 has no bar (unchecked): below its mean, the 0.0."""
    hints = ["h"] * 10
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.2, 0.6, 0.0, 1.0]
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    bars = {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5, 7: 1.0}  # a bar of a group with no row: unused
    kept, metrics = below_mean_rows(hints, rewards, groups, bars=bars)
    assert kept == [None, "h", "h", "h", None, None, "h", None, "h", None]
    assert metrics.local()["hint/teacher_fraction"] == pytest.approx(5 / 10)
    below_mean, _ = below_mean_rows(hints, rewards, groups)
    assert below_mean == [None, "h", None, None, None, None, "h", None, "h", None]
    # a bar of 0 (the teacher wrong too, `hint_trust: always`): no reply is below it
    assert below_mean_rows(["h", "h"], [0.0, 0.0], [0, 0], bars={0: 0.0})[0] == [None, None]


def test_below_the_teacher_reads_the_checks_own_scores(tokenizer):
    """Two groups, each teacher right and student wrong (trusted): group 0 has one right reply
    of two, group 1 none. Below the mean only group 0's wrong reply reads the teacher; below
    the teacher, group 1's two too (Dr. GRPO has no signal there, the teacher does)."""
    problems = PROBLEMS[:2]
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[_reply(tokenizer, "2"), _reply(tokenizer, "9")], [_reply(tokenizer, "9")] * 2]
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    for replies, teacher, fraction in (
        ("below_mean", [False, True, False, False], 1 / 3),
        ("below_teacher", [False, True, True, True], 3 / 3),
    ):
        check, _ = _check(tokenizer, ["2", "7"], ["3", "6"])
        plan = RolloutPlan(
            tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="user", check=check
        )
        rollout, metrics, _ = build_rollout(batch, episodes, replace(plan, teacher_replies=replies))
        assert rollout.has_teacher.tolist() == teacher
        assert metrics.local()["hint/teacher_fraction"] == pytest.approx(fraction)
    assert teacher_bars(check) == {0: 1.0, 1: 1.0}
    assert teacher_bars(None) == {}


# ---------------------------------------------------------------- the check
PROBLEMS = [{"task": "arithmetic", "prompt": f"{a}+{b}=", "answer": a + b} for a, b in
            [(1, 1), (2, 5), (3, 3), (4, 4)]]  # fmt: skip


def _check(tokenizer, teacher_says, student_says, trust="knows_better"):
    """A check of 4 groups whose first hinted turns are `PROBLEMS` (the last one a tool turn,
    unscored); the scripted engine answers the 4 teacher prompts, then the 4 students'."""
    replies = [_reply(tokenizer, t) for t in [*teacher_says, *student_says]]
    engine = _Engine(replies)
    check = HintCheck(trust, engine, SamplingConfig(temperature=0.7, max_tokens=4, seed=5))
    return check, engine


def test_a_group_keeps_its_teacher_only_where_the_hinted_teacher_knows_better(tokenizer):
    """Group 0: teacher right, student wrong (trusted). Group 1: both right. Group 2: teacher
    wrong, student right. Group 3: a tool turn, unscored (not trusted: it cannot be checked)."""
    problems = PROBLEMS
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[_reply(tokenizer, "9"), _reply(tokenizer, "9")] for _ in problems]  # all wrong
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    for ep in episodes[3]:  # a turn with a next state has no score of its own
        ep.turns[0].next_state = _NextState()
    check, engine = _check(tokenizer, ["2", "7", "5", "x"], ["3", "7", "6", "x"])
    rollout, metrics, _ = build_rollout(
        batch,
        episodes,
        RolloutPlan(tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="user", check=check),
    )
    ((prompts, n, used),) = engine.calls
    hints = [f"The answer is {p['answer']}." for p in problems]
    teacher = [
        single_turn_teacher(tokenizer, [{"role": "user", "content": p["prompt"]}], [], h, "user")
        for p, h in zip(problems, hints, strict=True)
    ]
    assert prompts == [t.teacher_ids for t in teacher] + batch.prompt_ids
    assert n == 1 and used.temperature == 0.0 and used.max_tokens == 4  # greedy, same length
    # only group 0's rows read the teacher; the others are RL-only (they all have a reward)
    assert rollout.has_teacher.tolist() == [True, True] + [False] * 6
    local = metrics.local()
    assert local["dispatch/opd_rl"] == 2 and local["dispatch/rl_only"] == 6
    assert local["hint/checked"] == 3 and local["hint/unchecked"] == 1
    assert local["hint/knows_better"] == 1 and local["hint/knows_worse"] == 1
    assert local["hint/teacher_accuracy"] == pytest.approx(2 / 3)
    assert local["hint/student_accuracy"] == pytest.approx(2 / 3)
    assert local["hint/gated_fraction"] == pytest.approx(6 / 8)


class _NextState:
    messages = [{"role": "tool", "content": "ok"}]
    tool_error = None


def test_always_uses_every_hint_and_still_measures(tokenizer):
    problems = PROBLEMS[:2]
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[_reply(tokenizer, "9")] for _ in problems]
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    check, _ = _check(tokenizer, ["5", "5"], ["2", "5"], trust="always")
    rollout, metrics, _ = build_rollout(
        batch,
        episodes,
        RolloutPlan(tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="user", check=check),
    )
    assert rollout.has_teacher.all()
    local = metrics.local()
    assert local["hint/gated_fraction"] == 0 and local["hint/knows_worse"] == 1


def test_the_placebo_teacher_reads_another_problems_hint(tokenizer):
    problems = PROBLEMS[:2]
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[_reply(tokenizer, "9")] for _ in problems]
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    rollout, _, rows = build_rollout(
        batch,
        episodes,
        RolloutPlan(
            tokenizer,
            4,
            VerifierScore(),
            hint=_Hint(),
            hint_role="user",
            samples_per_step=2,
            placebo_seed=0,
        ),
    )
    swapped = [
        single_turn_teacher(
            tokenizer, [{"role": "user", "content": p["prompt"]}], outs[i][0].token_ids,
            f"The answer is {problems[1 - i]['answer']}.", "user",
        ).teacher_ids
        for i, p in enumerate(problems)
    ]  # fmt: skip
    for i, ids in enumerate(swapped):
        n = len(ids)
        assert rollout.teacher_input_ids[i, :n].tolist() == ids
    assert [r["hint"] for r in rows] == ["The answer is 7.", "The answer is 2."]


def test_the_step_zero_line_says_whether_the_hint_helps():
    helps = {
        "hint/checked": 16.0,
        "hint/knows_better": 9.0,
        "hint/knows_worse": 1.0,
        "hint/teacher_accuracy": 0.75,
        "hint/student_accuracy": 0.25,
    }
    line = hint_line(helps, "knows_better", False)
    assert "scores 0.750 on 16 problems with a hint, 0.250 without it" in line
    assert "the hint helps the teacher" in line and "act on the 9 problem(s)" in line
    useless = helps | {"hint/knows_better": 1.0, "hint/knows_worse": 2.0}
    assert "the hint does NOT help" in hint_line(useless, "knows_better", False)
    assert "hints of other problems (placebo) do NOT help the teacher" in hint_line(
        useless, "always", True
    )
    assert "hints of other problems (placebo) help the teacher" in hint_line(helps, "always", True)
    assert "every hint is used" in hint_line(useless, "always", False)
    assert "replies below their group's mean reward" in hint_line(
        helps, "knows_better", 0, "below_mean"
    )
    assert "mean reward" not in hint_line(helps, "knows_better", False, "all")
    assert "on the replies that score below the hinted teacher's own" in hint_line(
        helps, "knows_better", False, "below_teacher"
    )
    tools = {"hint/checked": 0.0, "hint/unchecked": 4.0}
    assert "cannot be checked; their teacher signal is off" in hint_line(tools, "knows_better", 0)
    assert hint_line({}, "knows_better", False) is None


def test_a_run_says_at_step_zero_whether_the_hint_helps_and_logs_it(capsys):
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.opd import OPDHead
    from tests.test_hinted_replies import _fit

    trainer, calls = _fit([DrGRPOHead(), OPDHead()], steps=2)
    out = capsys.readouterr().out
    assert out.count("hint check, first batch: told the hint") == 1
    m = trainer.callback_metrics
    for name in ("hint/teacher_accuracy", "hint/student_accuracy", "hint/gated_fraction"):
        assert name in m
    checks = [c for c in calls if c[1] == 1]
    assert len(checks) == 2 and all(c[2] == 0.0 for c in checks)  # greedy, every step
    # a group the gate closed reads no teacher: its samples are RL-only
    assert float(m["dispatch/opd_rl"]) <= float(m["hint/knows_better"]) * 2


def test_the_check_needs_the_trainers_engine():
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.opd import OPDHead
    from composer_lightning.runtime.errors import ConfigError
    from tests.test_hinted_replies import _fit

    with pytest.raises(ConfigError, match="set rollout.hint_trust: always"):
        _fit([DrGRPOHead(), OPDHead()], steps=1, max_staleness=1)
    with pytest.raises(ConfigError, match="hint_trust must be one of"):
        _fit([DrGRPOHead(), OPDHead()], steps=1, hint_trust="sometimes")


# ---------------------------------------------------------------- the hint's template
def test_the_hint_template_puts_each_hint_where_it_says():
    from composer_lightning.chat import HINT_TEMPLATE, check_hint_template, fill_hint

    again = "{hint}\n\nCorrectly solve the original question."
    assert fill_hint(again, "It is 7.") == "It is 7.\n\nCorrectly solve the original question."
    assert fill_hint(again, ["a", "b"]) == [fill_hint(again, "a"), fill_hint(again, "b")]
    assert fill_hint(again, None) is None
    assert fill_hint("{hint} {x}", "{y}") == "{y} {x}"  # no other brace is read
    assert fill_hint(HINT_TEMPLATE, "It is 7.") == "It is 7."
    for bad in ("Solve it again.", "{hint} {hint}", None):
        with pytest.raises(ValueError, match=r"hint_template must be text holding \{hint\} once"):
            check_hint_template(bad)  # type: ignore[arg-type]


def test_the_teacher_and_the_sample_rows_read_the_templated_hint(tokenizer):
    problems = PROBLEMS[:2]
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[_reply(tokenizer, "9")] for _ in problems]
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    again = "{hint}\n\nCorrectly solve the original question."
    plan = RolloutPlan(
        tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="inline", samples_per_step=2
    )
    rollout, _, rows = build_rollout(batch, episodes, replace(plan, hint_template=again))
    for i, p in enumerate(problems):
        said = f"The answer is {p['answer']}.\n\nCorrectly solve the original question."
        ids = single_turn_teacher(
            tokenizer, [{"role": "user", "content": p["prompt"]}], outs[i][0].token_ids,
            said, "inline",
        ).teacher_ids  # fmt: skip
        assert rollout.teacher_input_ids[i, : len(ids)].tolist() == ids
        assert rows[i]["hint"] == said
    _, _, plain = build_rollout(batch, episodes, plan)  # the default: the hint itself
    assert [r["hint"] for r in plain] == [f"The answer is {p['answer']}." for p in problems]


def test_the_callback_refuses_a_template_without_the_hint():
    from composer_lightning.engines import HFEngine
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.rollout.callback import RolloutCallback

    with pytest.raises(
        ValueError,
        match=r"hint_template must be text holding \{hint\} once .where the hint goes., got 'Solve it.'",
    ):
        RolloutCallback(HFEngine(model_path=tiny_policy_path(), seed=0), hint_template="Solve it.")


def test_serve_teaches_with_the_judges_hint_in_the_template(tokenizer, tmp_path):
    """`serve` reads `hint_template` as `fit` does: the judge's hint, stored as it came, goes
    into the template where the teacher reads it; the default is the hint itself."""
    from composer_lightning.chat import render_ids
    from composer_lightning.engines import HFEngine
    from composer_lightning.serve.store import TurnStore
    from composer_lightning.serve.training import ServeCallback
    from composer_lightning.tasks.feedback import FeedbackScore

    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    prompt = render_ids(tokenizer, messages, add_generation_prompt=True)
    store = TurnStore(tmp_path / "turns.sqlite")
    store.record("s", messages, prompt, [29, 1], "3", [-0.5, -0.1], 0)
    store.end_session("s")
    (turn,) = store.claim_ready(1, claimant="j")
    store.set_judged(turn.id, 1.0, "It is 3.", claimant="j")
    turn = store.get(turn.id)
    again = "{hint}\n\nCorrectly solve the original question."
    for template, said in (("{hint}", "It is 3."), (again, again.replace("{hint}", "It is 3."))):
        cb = ServeCallback(
            HFEngine(model_path=tiny_policy_path()), score=FeedbackScore(),
            hint_role="inline", hint_template=template,
        )  # fmt: skip
        cb.store, cb._launch = store, 0
        ids = single_turn_teacher(tokenizer, messages, [29, 1], said, "inline").teacher_ids
        rb = cb.samples([turn], tokenizer, version=0)
        assert rb.teacher_input_ids[0, : len(ids)].tolist() == ids
        assert store.get(turn.id).hint == "It is 3."  # the store keeps the judge's own text
    with pytest.raises(ValueError, match=r"hint_template must be text holding \{hint\} once"):
        ServeCallback(HFEngine(model_path=tiny_policy_path()), score=FeedbackScore(),
                      hint_template="Solve it.")  # fmt: skip

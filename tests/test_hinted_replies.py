"""`rollout.hinted_replies`: which turns get a reply sampled from their hinted context, what the
engine is asked, how the replies are scored and laid out for `ContextDistillHead`, and the
settings' refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from composer_lightning.chat import single_turn_teacher, tokenize_prompt
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.rollout.dispatch import RolloutPlan, build_rollout
from composer_lightning.rollout.episodes import one_turn_episodes
from composer_lightning.rollout.hinted import (
    HintedReplies,
    HintedSampler,
    HintedTurn,
    first_per_group,
    sample_hinted,
)
from composer_lightning.tasks import HintProvider, VerifierScore


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_policy_path())


class _Engine:
    """A scripted engine: records each call, answers each prompt with the next reply."""

    def __init__(self, replies: list[Completion]):
        self.replies, self.calls = list(replies), []

    def __call__(self, prompts, n, sampling):
        self.calls.append((prompts, n, sampling))
        return [[self.replies.pop(0)] for _ in prompts]


class _Hint(HintProvider):
    """A hint for every wrong reply: the answer."""

    def hints(self, problems, completions):
        return [
            None if c.strip() == str(p["answer"]) else f"The answer is {p['answer']}."
            for p, c in zip(problems, completions, strict=True)
        ]


def _reply(tokenizer, text: str, finish: str = "stop") -> Completion:
    ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if finish == "stop" else [])
    return Completion(ids, [-0.1] * len(ids), finish)


def test_the_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="per_group must be an integer >= 1, got 0"):
        HintedReplies(per_group=0)
    with pytest.raises(ValueError, match="per_group must be an integer >= 1, got True"):
        HintedReplies(per_group=True)
    with pytest.raises(ValueError, match=r"temperature must be >= 0 \(0: greedy\) or None"):
        HintedReplies(temperature=-0.5)
    assert HintedReplies().temperature is None and HintedReplies(temperature=0).temperature == 0


def test_the_first_hinted_turns_of_each_group_are_taken_in_order():
    turns = [HintedTurn(g, [k], [k], None) for k, g in enumerate([0, 0, 1, 0, 2, 1, 1])]
    assert [t.student_ids[0] for t in first_per_group(turns, 1)] == [0, 2, 4]
    assert [t.student_ids[0] for t in first_per_group(turns, 2)] == [0, 1, 2, 4, 5]


def test_replies_are_sampled_from_the_hinted_prompt_and_set_after_the_students(tokenizer):
    problem = {"task": "arithmetic", "prompt": "3+4=", "answer": 7}
    turns = [
        HintedTurn(5, [1, 2, 3], [1, 2, 9, 9, 3], problem),  # scored: right
        HintedTurn(5, [1, 2, 3], [1, 2, 9, 9, 3], problem),  # scored: wrong
        HintedTurn(6, [4, 4], [4, 9, 4], None),  # unscored (a tool turn)
        HintedTurn(6, [4, 4], [4, 9, 4], problem),  # cut by max_tokens: dropped
    ]
    engine = _Engine(
        [
            _reply(tokenizer, "7"),
            _reply(tokenizer, "8"),
            _reply(tokenizer, "call"),
            _reply(tokenizer, "77", "length"),
        ]
    )
    sampling = SamplingConfig(temperature=0.7, max_tokens=4, seed=123)
    rows, metrics, texts = sample_hinted(
        turns,
        engine,
        sampling,
        HintedReplies(per_group=2, temperature=0.0),
        VerifierScore(),
        tokenizer,
    )
    ((prompts, n, used),) = engine.calls
    assert prompts == [t.teacher_prompt for t in turns] and n == 1
    assert used == replace(sampling, temperature=0.0)  # the seed kept, the temperature theirs
    assert rows.batch_size == 3 and rows.group_ids.tolist() == [5, 5, 6]
    assert rows.has_reward.tolist() == [True, True, False]
    assert rows.rewards.tolist()[:2] == [1.0, 0.0]
    seven = tokenizer.encode("7") + [tokenizer.eos_token_id]
    n0 = 3 + len(seven)
    assert rows.input_ids[0, :n0].tolist() == [1, 2, 3, *seven]
    assert rows.response_mask[0].tolist()[:n0] == [False] * 3 + [True] * len(seven)
    assert not rows.response_mask[0, n0:].any() and rows.attention_mask[0].sum() == n0
    local = metrics.local()
    assert local["hinted/replies"] == 3 and local["hinted/truncated"] == 1
    assert local["hinted/scored"] == 2
    assert texts == ["7", "8", "call"]  # each row's reply, decoded
    assert local["hinted/reward_mean"] == 0.5


def test_build_rollout_samples_hinted_replies_without_teacher_contexts(tokenizer):
    """With no head reading a teacher (`teacher=False`), the hints only seed the hinted
    replies: no row gets a teacher context, and a hinted-only row is dropped as before."""
    problems = [
        {"task": "arithmetic", "prompt": "1+1=", "answer": 2},
        {"task": "arithmetic", "prompt": "2+5=", "answer": 7},
    ]
    batch = PromptBatch(3, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [
        [_reply(tokenizer, "2"), _reply(tokenizer, "3")],  # the second is wrong: hinted
        [_reply(tokenizer, "1"), _reply(tokenizer, "4")],  # both wrong: hinted
    ]
    episodes = one_turn_episodes(problems, batch.prompt_ids, outs, tokenizer)
    engine = _Engine([_reply(tokenizer, "2"), _reply(tokenizer, "7"), _reply(tokenizer, "5")])
    sampler = HintedSampler(HintedReplies(per_group=2), engine, SamplingConfig(seed=1))
    rollout, metrics, rows = build_rollout(batch, episodes, RolloutPlan(tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="user", samples_per_step=2, teacher=False, hinted=sampler))  # fmt: skip
    # each group's sample row shows its first hinted reply and that reply's score
    assert [(r["hinted_reply"], r["hinted_reward"]) for r in rows] == [("2", 1.0), ("7", 1.0)]
    assert not rollout.has_teacher.any()
    ((prompts, n, _),) = engine.calls
    # group 6 (batch 3 x 2 prompts + 0): its one hinted turn; group 7: both
    teacher = [
        single_turn_teacher(tokenizer, [{"role": "user", "content": p["prompt"]}], [], h, "user")
        for p, h in [(problems[0], "The answer is 2."), (problems[1], "The answer is 7.")]
    ]
    assert prompts == [teacher[0].teacher_ids, teacher[1].teacher_ids, teacher[1].teacher_ids]
    hinted = rollout.hinted
    assert hinted.group_ids.tolist() == [6, 7, 7] and rollout.group_ids.tolist() == [6, 6, 7, 7]
    assert hinted.rewards.tolist() == [1.0, 1.0, 0.0] and hinted.has_reward.all()
    assert torch.equal(
        hinted.input_ids[1, : len(batch.prompt_ids[1])], torch.tensor(batch.prompt_ids[1])
    )
    assert metrics.local()["hinted/replies"] == 3
    # with a teacher read too, the same hints also make the rows' teacher contexts
    engine.replies = [_reply(tokenizer, "2")] * 3
    both, _, _ = build_rollout(
        batch,
        episodes,
        RolloutPlan(tokenizer, 4, VerifierScore(), hint=_Hint(), hint_role="user", hinted=sampler),
    )
    assert both.has_teacher.tolist() == [False, True, True, True] and both.hinted.batch_size == 3


def _fit(heads, steps=2, **callback_kw):
    import lightning as L

    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import HFEngine
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.tasks import VerifierHint
    from composer_lightning.training.module import ComposerModule
    from tests.helpers import quiet_trainer

    policy = tiny_policy_path()
    engine = HFEngine(model_path=policy, seed=0)
    calls = []
    generate = engine.generate

    def counted(prompts, n, sampling):
        calls.append((len(prompts), n, sampling.temperature, sampling.seed))
        return generate(prompts, n=n, sampling=sampling)

    engine.generate = counted  # type: ignore[method-assign]
    callback_kw.setdefault("hint", VerifierHint())
    cb = RolloutCallback(
        engine, group_size=2, sampling=SamplingConfig(max_tokens=6, seed=0), **callback_kw
    )
    module = ComposerModule(policy, heads, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    dm = RolloutDataModule(tokenizer=policy, prompts_per_step=4)
    trainer = quiet_trainer(max_steps=steps, callbacks=[cb], limit_val_batches=0)
    assert isinstance(trainer, L.Trainer)
    trainer.fit(module, dm)
    return trainer, calls


def test_a_run_samples_hinted_replies_only_while_the_head_reads_them():
    from composer_lightning.heads.context_distill import ContextDistillHead
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.schedules import LinearRamp

    ramp = LinearRamp(1.0, 0.0, start_step=1, end_step=2)  # weight 1, 1, then 0 from step 2
    heads = [DrGRPOHead(), ContextDistillHead(schedule=ramp)]
    trainer, calls = _fit(heads, steps=3, hinted_replies=HintedReplies(temperature=0.0))
    # each step: the group's rollouts (n = 2 at T 1.0), then while the head reads them, one
    # greedy reply per hinted group (the tiny policy is wrong often enough: every group), and
    # the hint check's greedy replies (a seed range of their own, 10**9 above)
    rollouts = [c for c in calls if c[1] == 2]
    hinted = [c for c in calls if c[1] == 1 and c[3] < 3 * 10**9]
    checks = [c for c in calls if c[1] == 1 and c[3] >= 3 * 10**9]
    assert [c[2] for c in rollouts] == [1.0] * 3
    assert len(hinted) == 2 and all(c[2] == 0.0 and 1 <= c[0] <= 4 for c in hinted)
    assert len(checks) == 2 and all(
        c[2] == 0.0 and c[0] == 2 * h[0] for c, h in zip(checks, hinted, strict=True)
    )
    m = trainer.callback_metrics
    assert float(m["dispatch/opd_rl"]) + float(m["dispatch/opd_only"]) == 0  # no teacher ran


def test_hinted_replies_and_their_head_come_together():
    from composer_lightning.heads.context_distill import ContextDistillHead
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.hinted_replies is None: set it"):
        _fit([DrGRPOHead(), ContextDistillHead()], steps=1)
    with pytest.raises(ConfigError, match="no head with a non-zero weight imitates"):
        _fit([DrGRPOHead()], steps=1, hinted_replies=HintedReplies())
    from composer_lightning.engines import HFEngine
    from composer_lightning.rollout.callback import RolloutCallback

    engine = HFEngine(model_path=tiny_policy_path(), seed=0)
    with pytest.raises(ValueError, match="rollout.hint is None: give the rollout a hint provider"):
        RolloutCallback(engine, hinted_replies=HintedReplies())
    with pytest.raises(ValueError, match="hinted_replies with max_staleness=1"):
        RolloutCallback(engine, hint=_Hint(), max_staleness=1, hinted_replies=HintedReplies())


def test_source_hint_imitates_the_hints_own_text_and_samples_nothing(tokenizer):
    """`source: hint`: the reply is the hint's text (ended by EOS), scored as a reply: SFT on
    the reference reply a hint states, the baseline of context distillation."""
    problem = {"task": "arithmetic", "prompt": "3+4=", "answer": 7}
    turns = [
        HintedTurn(5, [1, 2, 3], [1, 2, 9, 9, 3], problem, "7"),
        HintedTurn(6, [4, 4], [4, 9, 4], problem, "8"),
    ]
    engine = _Engine([])
    rows, metrics, texts = sample_hinted(
        turns,
        engine,
        SamplingConfig(max_tokens=4, seed=1),
        HintedReplies(source="hint"),
        VerifierScore(),
        tokenizer,
    )
    assert engine.calls == []  # nothing sampled
    assert texts == ["7", "8"] and rows.rewards.tolist() == [1.0, 0.0]
    seven = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]
    n0 = 3 + len(seven)
    assert rows.input_ids[0, :n0].tolist() == [1, 2, 3, *seven]
    assert rows.response_mask[0].tolist()[:n0] == [False] * 3 + [True] * len(seven)
    with pytest.raises(ValueError, match="source must be 'sampled' or 'hint', got 'judge'"):
        HintedReplies(source="judge")

"""The four-way dispatch as a pure decision (docs/design.md, "The four-way dispatch"): a score gives RL, a hint gives OPD."""

import torch
from transformers import AutoTokenizer

from composer_lightning.chat import tokenize_prompt
from composer_lightning.engines.base import Completion
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.rollout.dispatch import RolloutPlan, dispatch
from composer_lightning.rollout.dispatch import build_rollout as _build
from composer_lightning.rollout.episodes import one_turn_episodes
from composer_lightning.rollout.providers import provider_values
from composer_lightning.tasks import HintProvider, ScoreProvider, VerifierScore


def test_dispatch_keeps_samples_with_a_score_or_a_hint_and_counts_each_path():
    has_reward = [True, True, False, False, True]
    has_teacher = [True, False, True, False, False]
    keep, counts = dispatch(has_reward, has_teacher)
    assert keep == [0, 1, 2, 4]
    assert counts == {
        "dispatch/opd_rl": 1.0,
        "dispatch/opd_only": 1.0,
        "dispatch/rl_only": 2.0,
        "dispatch/dropped": 1.0,
    }
    assert dispatch([], []) == (
        [],
        {
            "dispatch/opd_rl": 0.0,
            "dispatch/opd_only": 0.0,
            "dispatch/rl_only": 0.0,
            "dispatch/dropped": 0.0,
        },
    )


def build_rollout(batch, outs, plan):
    """`dispatch.build_rollout` of single-turn completions (one-turn episodes)."""
    episodes = one_turn_episodes(batch.problems, batch.prompt_ids, outs, plan.tokenizer)
    return _build(batch, episodes, plan)


class _RaisingHints(HintProvider):
    def hints(self, problems, completions):
        raise ConnectionError("judge unreachable")


class _Scores(ScoreProvider):
    def __init__(self, values):
        self.values = values

    def score(self, problems, completions):
        return list(self.values)


def test_a_provider_that_raises_or_returns_bad_values_fails_its_samples_and_is_counted(caplog):
    with caplog.at_level("WARNING"):
        assert provider_values(_RaisingHints(), "hint", [{}] * 2, ["a", "b"]) == ([None] * 2, 2)
        assert provider_values(_Scores([1.0]), "score", [{}] * 2, ["a", "b"]) == ([None] * 2, 2)
        assert provider_values(_Scores(["1", 0.5]), "score", [{}] * 2, ["a", "b"]) == (
            [None, 0.5],
            1,
        )
    assert [r.getMessage() for r in caplog.records] == [
        "hint provider _RaisingHints raised on the whole batch (no sample gets a hint): "
        "ConnectionError: judge unreachable",
        "score provider _Scores returned 1 values for 2 samples (no sample gets a score)",
        "score provider _Scores returned str '1' on sample 0, expected a number (bool, int or "
        "float) (it gets no score)",
    ]


def test_a_raising_hint_provider_leaves_the_batch_to_its_rewards_with_one_summary_line(caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_path())
    problems = [{"task": "arithmetic", "prompt": "1+1=", "answer": 2}] * 2
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    outs = [[Completion(tokenizer.encode("2"), [-0.5], "length")] * 2] * 2
    with caplog.at_level("WARNING"):
        rollout, metrics, _ = build_rollout(
            batch,
            outs,
            RolloutPlan(tokenizer, 4, VerifierScore(), hint=_RaisingHints(), hint_role="user"),
        )
    local = metrics.local()
    assert local["rollout/hint_failures"] == 4 and local["dispatch/rl_only"] == 4
    assert rollout.batch_size == 4 and not rollout.has_teacher.any()
    assert caplog.records[-1].getMessage() == (
        "rollout batch 0: 4 of 4 hint calls failed (one line each above); those samples get no hint"
    )


def test_masked_truncated_completions_keep_their_reward_but_no_loss_token():
    """TRL's `mask_truncated_completions`: a completion that hit max_tokens (finish "length")
    has no response token, while its reward stays in the batch for the group baseline."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_path())
    problem = {"messages": [{"role": "user", "content": "1+1="}], "task": "arithmetic", "answer": 2}
    batch = PromptBatch(0, [problem], [tokenize_prompt(tokenizer, problem)])
    eos = tokenizer.eos_token_id
    outs = [
        [
            Completion(tokenizer.encode("2") + [eos], [-0.5, -0.1], "stop"),
            Completion(tokenizer.encode("3") + tokenizer.encode("3"), [-0.5, -0.2], "length"),
        ]
    ]
    plain, _, _ = build_rollout(
        batch, outs, RolloutPlan(tokenizer, 2, VerifierScore(), hint_role="user")
    )
    masked, metrics, _ = build_rollout(
        batch,
        outs,
        RolloutPlan(tokenizer, 2, VerifierScore(), hint_role="user", mask_truncated=True),
    )
    assert metrics.local()["rollout/masked_truncated"] == 1.0
    assert plain.response_mask[1].any() and not masked.response_mask[1].any()
    assert torch.equal(masked.response_mask[0], plain.response_mask[0])
    assert masked.has_reward.tolist() == [True, True]
    assert masked.rewards.tolist() == plain.rewards.tolist() == [1.0, 0.0]


class _Candidates(HintProvider):
    def hints(self, problems, completions):
        return [["a much longer first hint", "short"], "only one", None][: len(problems)]


def test_candidate_hints_become_teacher_contexts_shortest_first_and_the_first_is_the_hint():
    from composer_lightning.chat import single_turn_teacher

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_path())
    problems = [
        {"messages": [{"role": "user", "content": f"{i}+1="}], "task": "arithmetic", "answer": 9}
        for i in range(3)
    ]
    batch = PromptBatch(0, problems, [tokenize_prompt(tokenizer, p) for p in problems])
    response = tokenizer.encode("7")
    outs = [[Completion(response, [-0.5], "stop")] for _ in problems]
    rb, metrics, rows = build_rollout(
        batch,
        outs,
        RolloutPlan(
            tokenizer, 4, VerifierScore(), hint=_Candidates(), hint_role="user", samples_per_step=3
        ),
    )
    assert rb.has_candidate.tolist() == [[True, True], [True, False], [False, False]]
    assert rb.has_teacher.tolist() == [True, True, False]

    def context(i, hint):
        ids = single_turn_teacher(tokenizer, problems[i]["messages"], response, hint).teacher_ids
        return ids

    def row(c, i):
        n = int(rb.candidate_attention_mask[i, c].sum())
        return rb.candidate_input_ids[i, c, :n].tolist()

    assert row(0, 0) == context(0, "short") and row(1, 0) == context(0, "a much longer first hint")
    n0 = int(rb.teacher_attention_mask[0].sum())
    assert rb.teacher_input_ids[0, :n0].tolist() == context(0, "a much longer first hint")
    assert row(0, 1) == context(1, "only one")
    assert rb.candidate_positions[1, 1].eq(-1).all()  # the missing candidate maps nothing
    assert [r["hint"] for r in rows] == ["a much longer first hint", "only one", None]
    assert rows[0]["hint_candidates"] == ["a much longer first hint", "short"]
    assert "hint_candidates" not in rows[1]

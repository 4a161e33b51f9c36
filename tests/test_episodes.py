"""The episode loop on token ids: template deltas, limits, per-turn signals, faults."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from composer_lightning.chat import render_ids, single_turn_teacher, template_delta
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.envs import Observation, SingleTurn
from composer_lightning.functional import episode_advantages, grpo_advantages
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.protocols.prompts import PromptBatch
from composer_lightning.rollout.dispatch import RolloutPlan, build_rollout
from composer_lightning.rollout.episodes import run_episodes
from composer_lightning.tasks import ScoringError, ToolErrorHint, VerifierScore

TOK = AutoTokenizer.from_pretrained(tiny_policy_path())
EOT = TOK.eos_token_id
PROBLEM = {"messages": [{"role": "user", "content": "2+3="}], "task": "arithmetic", "answer": 5}


class ToolEnv:
    """A scripted tool: "CALL bad" is an error, "CALL good" returns 5, anything else ends."""

    tools = None

    def reset(self, problem):
        return list(problem["messages"])

    def step(self, message):
        text = message["content"]
        if text == "CALL bad":
            return Observation(
                [{"role": "tool", "content": "error: use CALL good"}],
                info={"tool_error": "error: use CALL good"},
            )
        if text == "CALL good":
            return Observation([{"role": "tool", "content": "5"}])
        return Observation(done=True)


def scripted(plans):
    """A generate function: sample j of a problem's first turn follows `plans[j % len(plans)]`;
    a later turn follows the plan whose first turn the context holds (each plan's first turn
    differs), writing `plan[turn]`, the turn read from the context's assistant headers."""
    header = TOK.convert_tokens_to_ids("<|assistant|>")
    calls = []

    def plan_of(ids):
        text = TOK.decode(ids, skip_special_tokens=False)
        first = text.split("<|assistant|>")[1].split("<|eot|>")[0]
        return next(p for p in plans if p[0] == first)

    def generate(prompts, n, sampling):
        calls.append((len(prompts), n, sampling.seed, sampling.max_tokens))
        out = []
        for ids in prompts:
            turn = ids.count(header) - 1
            group = []
            for j in range(n):
                plan = plans[j % len(plans)] if turn == 0 else plan_of(ids)
                text = plan[min(turn, len(plan) - 1)]
                tokens = TOK.encode(text, add_special_tokens=False) + [EOT]
                finish = "stop"
                if len(tokens) > sampling.max_tokens:
                    tokens, finish = tokens[: sampling.max_tokens], "length"
                group.append(Completion(tokens, [-0.25] * len(tokens), finish))
            out.append(group)
        return out

    generate.calls = calls
    return generate


SAMPLING = SamplingConfig(max_tokens=16, seed=100)


def _run(plans, env=ToolEnv, group=1, **kwargs):
    return run_episodes(
        scripted(plans),
        [PROBLEM],
        [render_ids(TOK, PROBLEM["messages"], True)],
        lambda p: env(),
        TOK,
        SAMPLING,
        group,
        **kwargs,
    )[0]


def test_turns_are_appended_as_template_deltas_and_equal_the_whole_conversation():
    (ep,) = _run([["CALL bad", "CALL good", "5"]], max_turns=4)
    assert ep.status == "done" and len(ep.turns) == 3
    assert [m["role"] for m in ep.messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]
    assert ep.ids == render_ids(TOK, ep.messages)  # the concatenation is the whole template
    for turn in ep.turns:  # each turn was generated from its context's ids exactly
        assert turn.context_ids == render_ids(TOK, turn.context, add_generation_prompt=True)
    assert not ep.retokenized_differently
    assert ep.turns[0].next_state.tool_error == "error: use CALL good"
    assert ep.turns[1].has_next_state and not ep.turns[2].has_next_state


def test_a_template_that_rewrites_earlier_turns_is_one_clear_error():
    class Rewriting:
        chat_template = "x"
        name_or_path = "rewriting"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
            last = messages[-1]["content"]  # only the newest message survives
            return last + ("<|assistant|>" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": TOK(text, add_special_tokens=False)["input_ids"]}

    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(
        ValueError, match="not prefix-stable: appending \\['tool'\\] after message 1"
    ):
        template_delta(Rewriting(), chat, [{"role": "tool", "content": "c"}], None)
    assert (
        template_delta(TOK, chat, [{"role": "tool", "content": "c"}], None)
        == render_ids(TOK, [*chat, {"role": "tool", "content": "c"}], True)[
            len(render_ids(TOK, chat)) :
        ]
    )


def test_episodes_of_one_group_end_at_different_turns_and_seeds_never_repeat():
    generate = scripted([["5"], ["CALL good", "5"], ["CALL bad", "CALL good", "5"]])
    eps = run_episodes(
        generate,
        [PROBLEM],
        [render_ids(TOK, PROBLEM["messages"], True)],
        lambda p: ToolEnv(),
        TOK,
        SAMPLING,
        3,
        max_turns=3,
    )[0]
    assert [len(e.turns) for e in eps] == [1, 2, 3]
    assert [e.status for e in eps] == ["done", "done", "done"]
    # turn 0: the problem's G samples in one call; turn k: seed + k * P * G, one per episode
    assert [(c[0], c[1], c[2]) for c in generate.calls] == [(1, 3, 100), (2, 1, 103), (1, 1, 106)]


def test_limits_end_an_episode_marked_not_crashed():
    (forever,) = _run([["CALL good"]], max_turns=3)
    assert forever.status == "max_turns" and len(forever.turns) == 3
    (budget,) = _run([["CALL bad", "CALL good", "5"]], max_turns=3, max_episode_tokens=40)
    assert (
        budget.status == "truncated" and sum(len(t.completion.token_ids) for t in budget.turns) > 0
    )
    assert len(budget.ids) <= 40
    (cut,) = _run([["CALL good" * 10]], max_turns=3)  # longer than max_tokens: cut mid-turn
    assert cut.status == "truncated" and cut.turns[0].completion.finish_reason == "length"


def _problem(content):
    return {"messages": [{"role": "user", "content": content}], "task": "arithmetic", "answer": 5}


def test_turn_zero_gives_each_problem_the_room_its_own_opening_leaves():
    """A long opening beside a short one: each gets max_episode_tokens minus its own length
    (one call per budget, seeds not reused), not the batch's smallest budget."""
    problems = [_problem("2+3="), _problem("2+3= " + "please add these " * 6)]
    ids = [render_ids(TOK, p["messages"], True) for p in problems]
    short, long = len(ids[0]), len(ids[1])
    assert long > short + 10
    generate = scripted([["5"]])
    limit = long + 8
    run_episodes(generate, problems, ids, lambda p: ToolEnv(), TOK, SAMPLING, 2, 1, limit)
    calls = sorted(generate.calls, key=lambda c: c[3])
    assert [(c[0], c[1], c[3]) for c in calls] == [(1, 2, 8), (1, 2, min(16, limit - short))]
    assert sorted(c[2] for c in calls) == [100, 102]  # seed ranges of 2 samples each, disjoint
    # equal budgets: one call with the whole batch, as a single-turn rollout
    generate = scripted([["5"]])
    run_episodes(generate, problems, ids, lambda p: ToolEnv(), TOK, SAMPLING, 2, 1, None)
    assert generate.calls == [(2, 2, 100, 16)]


def test_an_opening_without_room_fails_its_own_episodes_and_the_batch_goes_on():
    problems = [_problem("2+3="), _problem("2+3= " + "please add these " * 6)]
    ids = [render_ids(TOK, p["messages"], True) for p in problems]
    ok, full = run_episodes(
        scripted([["5"]]), problems, ids, lambda p: ToolEnv(), TOK, SAMPLING, 2, 1, len(ids[1])
    )
    assert [e.status for e in ok] == ["done", "done"]
    assert [e.status for e in full] == ["failed", "failed"] and not full[0].turns
    assert full[0].error == (
        f"its opening has {len(ids[1])} tokens: no room for a reply within "
        f"max_episode_tokens {len(ids[1])}"
    )
    rollout, metrics, _ = build_rollout(
        PromptBatch(0, problems, ids),
        [ok, full],
        RolloutPlan(TOK, 16, VerifierScore(), hint_role="user"),
    )
    assert rollout.input_ids.shape[0] == 2  # the two episodes that ran; the others dropped


class Raising(ToolEnv):
    def step(self, message):
        raise RuntimeError("tool server down")


class Hanging(ToolEnv):
    def step(self, message):
        time.sleep(30)


class Malformed(ToolEnv):
    def step(self, message):
        return Observation([{"text": "no role"}])


class NotAnObservation(ToolEnv):
    def step(self, message):
        return {"done": True}


@pytest.mark.parametrize(
    "env, why",
    [
        (Raising, "step raised RuntimeError: tool server down"),
        (Hanging, "step timed out after 0.5 s"),
        (Malformed, "step raised TypeError: step returned a malformed message"),
        (NotAnObservation, "step raised TypeError: step returned dict, expected an Observation"),
    ],
)
def test_a_broken_environment_fails_its_episode_with_one_warning(env, why, caplog):
    with caplog.at_level("WARNING"):
        (ep,) = _run([["CALL good", "5"]], env=env, max_turns=2, env_timeout=0.5)
    assert ep.status == "failed" and ep.error.startswith(why)
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        f"episode on '2+3=' failed: {ep.error}"
    ]


def _batch(eps):
    return PromptBatch(0, [PROBLEM], [eps[0].turns[0].context_ids])


def test_turns_are_rows_with_the_episode_reward_and_their_own_hint():
    eps = run_episodes(
        scripted([["CALL bad", "CALL good", "5"], ["CALL good", "4"]]),
        [PROBLEM],
        [render_ids(TOK, PROBLEM["messages"], True)],
        lambda p: ToolEnv(),
        TOK,
        SAMPLING,
        2,
        max_turns=3,
    )
    rb, metrics, rows = build_rollout(
        _batch(eps[0]),
        eps,
        RolloutPlan(
            TOK, 16, VerifierScore(), hint=ToolErrorHint(), hint_role="user", samples_per_step=1
        ),
    )
    assert rb.batch_size == 5  # 3 + 2 turns: every turn is a row
    assert rb.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # the outcome, on every turn
    assert rb.episode_ids.tolist() == [0, 0, 0, 1, 1] and rb.group_ids.tolist() == [0] * 5
    assert rb.has_teacher.tolist() == [True, False, False, False, False]  # the error turn
    local = metrics.local()
    assert (local["dispatch/opd_rl"], local["dispatch/rl_only"]) == (1.0, 4.0)
    assert local["episode/tool_errors"] == 1.0 and local["episode/turns"] == 2.5
    for b, (e, t) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]):
        turn = eps[0][e].turns[t]
        n = len(turn.context_ids)
        ids = rb.input_ids[b, : n + len(turn.completion.token_ids)].tolist()
        assert ids == turn.context_ids + turn.completion.token_ids
        assert rb.response_mask[b].nonzero().flatten().tolist() == list(
            range(n, n + len(turn.completion.token_ids))
        )  # this turn's assistant tokens only
        assert rb.engine_logprobs[b, n : n + len(turn.completion.token_ids)].eq(-0.25).all()
    # the teacher of the error turn: its context, the hint as a user message, the same ids
    turn = eps[0][0].turns[0]
    teacher = single_turn_teacher(
        TOK, turn.context, turn.completion.token_ids, "error: use CALL good"
    )
    width = len(teacher.teacher_ids)
    assert rb.teacher_input_ids[0, :width].tolist() == teacher.teacher_ids
    assert rb.sdpo_mask[0].sum() == len(turn.completion.token_ids) and not rb.sdpo_mask[1:].any()
    # the sample row is the whole episode as chat messages, each turn with its reward and hint
    (row,) = rows
    assert [m["role"] for m in row["messages"]] == ["user"] + ["assistant", "tool"] * 2 + [
        "assistant"
    ]
    assert (
        row["messages"][1]["hint"] == "error: use CALL good" and row["messages"][3]["hint"] is None
    )
    assert row["reward"] == 1.0 and row["status"] == "done"
    # by default (below the mean) the error turn keeps its hint although its episode succeeded:
    # a turn with a next state is not judged by the outcome (it is the teacher's to teach)
    plan = RolloutPlan(TOK, 16, VerifierScore(), hint=ToolErrorHint(), teacher_replies="below_mean")
    below, _, _ = build_rollout(_batch(eps[0]), eps, plan)
    assert below.has_teacher.tolist() == [True, False, False, False, False]


def test_a_batch_whose_every_episode_failed_stops_with_one_error():
    eps = [_run([["CALL good"]], env=Raising, group=2, max_turns=2)]
    with pytest.raises(ScoringError, match="every episode of rollout batch 0 failed"):
        build_rollout(
            PromptBatch(0, [PROBLEM], [[1]]),
            eps,
            RolloutPlan(TOK, 16, VerifierScore(), hint_role="user"),
        )


def test_a_single_turn_task_is_an_episode_of_one_turn_sampled_as_before():
    generate = scripted([["5"], ["4"]])
    prompt = render_ids(TOK, PROBLEM["messages"], True)
    eps = run_episodes(generate, [PROBLEM], [prompt], lambda p: SingleTurn(), TOK, SAMPLING, 2)
    assert generate.calls == [(1, 2, 100, 16)]  # the one call a single-turn rollout makes
    assert [e.status for e in eps[0]] == ["done", "done"] and eps[0][0].ids[: len(prompt)] == prompt


def test_episode_advantages_count_each_episode_once_in_its_group():
    """Hand-derived: group 0 has episodes of 3, 1 and 2 turns with rewards 1, 0, 0.5 → mean 0.5
    (not the row mean 7/12); group 1 has one episode of 2 turns (no baseline: A = R)."""
    rewards = torch.tensor([1.0, 1, 1, 0, 0.5, 0.5, 0.25, 0.25], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    episodes = torch.tensor([7, 7, 7, 3, 5, 5, 9, 9])
    adv = episode_advantages(rewards, groups, episodes)
    expected = torch.tensor([0.5, 0.5, 0.5, -0.5, 0, 0, 0.25, 0.25], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    unique = torch.arange(8)  # one row per episode: GRPO itself, std scaling included
    for scale in ("none", "group", "batch"):
        torch.testing.assert_close(
            episode_advantages(rewards, groups, unique, scale_rewards=scale),
            grpo_advantages(rewards, groups, scale_rewards=scale),
            rtol=0,
            atol=1e-12,
        )
    # std-scaled: the std of the group's three episode rewards (1, 0, 0.5), unbiased
    scaled = episode_advantages(rewards, groups, episodes, scale_rewards="group")
    torch.testing.assert_close(scaled[0], torch.tensor(0.5 / (0.5 + 1e-4), dtype=torch.float64))
    with pytest.raises(ValueError, match="share their rewards"):
        episode_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([1, 1]))


def test_the_engines_ids_are_kept_when_the_tokenizer_would_spell_the_turn_differently():
    """A turn sampled as single characters re-tokenises into merged tokens: the next turn's
    context keeps the sampled ids (what the log-probs are of), and the difference is counted."""
    spelled = [TOK.convert_tokens_to_ids(ch) for ch in "CALLĠgood"] + [EOT]
    assert spelled[:-1] != TOK.encode("CALL good", add_special_tokens=False)
    header = TOK.convert_tokens_to_ids("<|assistant|>")

    def generate(prompts, n, sampling):
        first = prompts[0].count(header) == 1
        ids = spelled if first else TOK.encode("5", add_special_tokens=False) + [EOT]
        return [[Completion(ids, [-0.25] * len(ids), "stop")] * n for _ in prompts]

    prompt = render_ids(TOK, PROBLEM["messages"], True)
    (ep,) = run_episodes(generate, [PROBLEM], [prompt], lambda p: ToolEnv(), TOK, SAMPLING, 1, 2)[0]
    second = ep.turns[1].context_ids
    assert second[len(prompt) : len(prompt) + len(spelled)] == spelled
    assert ep.retokenized_differently and second != render_ids(TOK, ep.turns[1].context, True)


class _TurnScore:
    """A per-turn score that reads the next state: +1 after a tool result, −1 after an error."""

    failures = 0

    def score(self, problems, completions):
        return [-1.0 if p.get("tool_error") else 1.0 for p in problems]


def test_a_turn_score_rewards_each_turn_with_a_next_state_as_its_own_sample():
    eps = run_episodes(
        scripted([["CALL bad", "CALL good", "5"]]),
        [PROBLEM],
        [render_ids(TOK, PROBLEM["messages"], True)],
        lambda p: ToolEnv(),
        TOK,
        SAMPLING,
        1,
        max_turns=3,
    )
    rb, _, rows = build_rollout(
        _batch(eps[0]),
        eps,
        RolloutPlan(
            TOK, 16, VerifierScore(), hint_role="user", samples_per_step=1, turn_score=_TurnScore()
        ),
    )
    assert rb.rewards.tolist() == [-1.0, 1.0, 1.0]  # the error turn, the call, the outcome
    ids = rb.episode_ids.tolist()
    assert len(set(ids)) == 3  # each per-turn-scored turn is a sample of its own
    assert [m.get("reward") for m in rows[0]["messages"] if m["role"] == "assistant"] == [
        -1.0,
        1.0,
        1.0,
    ]


def test_with_a_turn_score_an_episode_cut_at_max_turns_keeps_its_outcome_on_the_last_turn():
    """An episode that only calls tools until max_turns: its turns before the last get the turn
    score, the last the outcome (0: "CALL good" is no answer), never +1 like a solved task."""
    eps = run_episodes(
        scripted([["5"], ["CALL good"]]),
        [PROBLEM],
        [render_ids(TOK, PROBLEM["messages"], True)],
        lambda p: ToolEnv(),
        TOK,
        SAMPLING,
        2,
        max_turns=2,
    )
    solved, looping = eps[0]
    assert solved.status == "done" and looping.status == "max_turns"
    assert looping.turns[-1].has_next_state
    rb, _, _ = build_rollout(
        _batch(eps[0]),
        eps,
        RolloutPlan(
            TOK, 16, VerifierScore(), hint_role="user", samples_per_step=1, turn_score=_TurnScore()
        ),
    )
    assert rb.rewards.tolist() == [1.0, 1.0, 0.0]  # solved; looping's call, then its outcome
    ids = rb.episode_ids.tolist()
    assert ids[2] != ids[1] and ids[2] == 1  # the last turn is the episode's own sample


def test_environments_of_different_episodes_are_stepped_concurrently():
    """Liveness by what happened: each episode's environment waits at one barrier of 4 parties
    in both its reset and its step, so the batch's 4 episodes end only if their calls were all in
    flight at once (`env_workers=8`); one at a time (`env_workers=1`) each call waits alone and
    times out. The episodes are the same as without the barrier."""
    import threading

    meet = {"barrier": threading.Barrier(4, timeout=60)}

    class Meeting(ToolEnv):
        def reset(self, problem):
            meet["barrier"].wait()
            return super().reset(problem)

        def step(self, message):
            meet["barrier"].wait()
            return super().step(message)

    plans = [["CALL bad", "CALL good", "5"], ["CALL good", "CALL good", "5"]]  # 3 turns each
    together = _run(plans, env=Meeting, group=4, max_turns=3, env_workers=8)
    plain = _run(plans, env=ToolEnv, group=4, max_turns=3, env_workers=1)
    assert [e.status for e in together] == [e.status for e in plain] == ["done"] * 4
    assert [e.ids for e in together] == [e.ids for e in plain]
    assert [e.messages for e in together] == [e.messages for e in plain]
    meet["barrier"] = threading.Barrier(4, timeout=0.2)
    alone = _run(plans, env=Meeting, group=4, max_turns=3, env_workers=1, env_timeout=30)
    assert [e.status for e in alone] == ["failed"] * 4
    assert all(e.error.startswith("reset raised BrokenBarrierError") for e in alone)


def test_a_hung_environment_fails_only_its_own_episode_among_concurrent_ones(caplog):
    """One of 4 concurrent environments never answers its step: its episode fails after
    `env_timeout`, the other three finish."""
    import threading

    never = threading.Event()
    made = []

    class SomeHang(ToolEnv):
        def __init__(self):
            made.append(self)
            self.hangs = len(made) == 2

        def step(self, message):
            if self.hangs:
                never.wait()
            return super().step(message)

    eps = _run([["CALL good", "5"]], env=SomeHang, group=4, max_turns=2, env_timeout=0.5)
    assert [e.status for e in eps] == ["done", "failed", "done", "done"]
    assert eps[1].error == "step timed out after 0.5 s"


def test_a_truncation_penalty_makes_running_out_of_tokens_cost_where_every_outcome_is_0():
    """Two episodes of one problem, both wrong (outcome 0): one answers "4", one is cut at
    `max_tokens` mid-turn. Without a penalty their rewards tie (no advantage: nothing teaches
    the cut one); with `truncation_penalty=0.5` the cut one gets −0.5 on each of its turns and
    the answered one keeps 0."""
    eps = [_run([["CALL good", "4"], ["CALL bad", "CALL good" * 10]], group=2, max_turns=3)]
    assert [ep.status for ep in eps[0]] == ["done", "truncated"]
    plan = RolloutPlan(TOK, 16, VerifierScore(), samples_per_step=1)
    plain, _, _ = build_rollout(_batch(eps[0]), eps, plan)
    assert plain.rewards.tolist() == [0.0, 0.0, 0.0, 0.0]
    penalised, _, _ = build_rollout(_batch(eps[0]), eps, replace(plan, truncation_penalty=0.5))
    assert penalised.rewards.tolist() == [0.0, 0.0, -0.5, -0.5]
    assert penalised.episode_ids.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("bad", [-0.1, True, float("nan")])
def test_a_bad_truncation_penalty_is_refused_by_name(bad):
    from composer_lightning.engines import HFEngine
    from composer_lightning.rollout.callback import RolloutCallback

    with pytest.raises(ValueError, match="truncation_penalty must be >= 0, got"):
        RolloutCallback(HFEngine(model_path=tiny_policy_path()), truncation_penalty=bad)


def test_the_share_of_tool_episodes_without_a_call_is_a_step_metric():
    """Of two episodes with tools one calls ("CALL good", then answers) and one answers at once:
    `episode/no_call_rate` 0.5; episodes without tools do not report it."""

    class WithTools(ToolEnv):
        tools = [{"type": "function", "function": {"name": "good", "parameters": {}}}]

    def rate(env):
        eps = [_run([["CALL good", "5"], ["5"]], env=env, group=2, max_turns=3)]
        _, metrics, _ = build_rollout(
            _batch(eps[0]),
            eps,
            RolloutPlan(TOK, 16, VerifierScore(), hint_role="user", samples_per_step=1),
        )
        return metrics.local().get("episode/no_call_rate")

    assert rate(WithTools) == 0.5
    assert rate(ToolEnv) is None

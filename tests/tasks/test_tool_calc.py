"""The tool_calc task: problems, its calculator environment, and the final-answer verifier."""

from __future__ import annotations

import random

import pytest

from composer_lightning.envs import PythonToolEnv
from composer_lightning.tasks import Verdict, get_task
from composer_lightning.tasks.tool_calc import PHRASINGS, ToolCalc, final_answer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 45}}</tool_call>'


def test_lookup_and_problem_shape() -> None:
    task = get_task("tool_calc")
    assert isinstance(task, ToolCalc)
    problems = task.samples(200, seed=3)
    assert problems == task.samples(200, seed=3)
    assert {p["phrasing"] for p in problems} == {0, 1}
    for p in problems:
        assert p["task"] == "tool_calc" and int(p["answer"]) == p["a"] + p["b"]
        assert 10 <= p["a"] <= 999 and 10 <= p["b"] <= 999
        assert p["messages"] == [
            {"role": "user", "content": PHRASINGS[p["phrasing"]].format(a=p["a"], b=p["b"])}
        ]
    assert ToolCalc().make(123, 45, 1)["messages"][0]["content"] == (
        "Let x = 123 and y = 45. What is x + y?"
    )


def test_the_environment_is_a_fresh_calculator_per_episode() -> None:
    task = ToolCalc()
    problem = task.make(123, 45)
    env = task.environment(problem)
    assert isinstance(env, PythonToolEnv) and env is not task.environment(problem)
    assert [t["function"]["name"] for t in env.tools] == ["add"]
    assert env.reset(problem) == problem["messages"]
    obs = env.step({"role": "assistant", "content": CALL})
    assert obs.messages == [{"role": "tool", "content": "168"}] and obs.tool_error is None
    bad = env.step({"role": "assistant", "content": CALL.replace('"a"', '"x"')})
    assert "expected add(a: int, b: int)" in bad.tool_error
    assert env.step({"role": "assistant", "content": "The answer is 168."}).done


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("The answer is 168.", 1.0),
        ("168", 1.0),
        ("123 + 45 = 168", 1.0),  # the last integer is the answer
        (f"{CALL} The answer is 168.", 1.0),  # read after the last call
        ("The answer is 167.", 0.0),
        (CALL, 0.0),  # a call is not an answer (45 is not read)
        ("I do not know.", 0.0),
    ],
)
def test_verifier_reads_the_final_answer(completion: str, reward: float) -> None:
    verdict = ToolCalc().verify(ToolCalc().make(123, 45), completion)
    assert verdict.reward == reward
    assert (verdict.hint is None) == (reward == 1.0)


def test_a_wrong_answer_gets_an_error_derived_hint() -> None:
    problem = ToolCalc().make(123, 45)
    assert ToolCalc().verify(problem, "The answer is 178.") == Verdict(
        0.0, "The answer has 3 digits; digit 2 (from the left) is 6."
    )
    assert ToolCalc().verify(problem, CALL).hint.startswith("Reply with a number.")
    assert final_answer(f"{CALL}\nSo 168.") == 168 and final_answer(CALL) is None


def test_two_terms_sample_the_problems_they_always_did() -> None:
    """`terms` left at 2 draws a, b, then the phrasing, as before it existed: every seed's
    problems (and so the held-out split and the shipped demonstrations) are unchanged."""
    rng, task = random.Random(11), ToolCalc()
    for problem in task.samples(50, seed=11):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        phrasing = int(rng.random() < 0.5)
        assert (problem["a"], problem["b"], problem["phrasing"]) == (a, b, phrasing)
        assert problem["terms"] == [a, b]


def test_three_terms_ask_a_chain_of_calls() -> None:
    task = ToolCalc(terms=3)
    for p in task.samples(40, seed=0):
        assert len(p["terms"]) == 3 and int(p["answer"]) == sum(p["terms"])
        assert all(10 <= v <= 999 for v in p["terms"])
    assert task.make(123, 45, 0, (678,))["messages"][0]["content"] == "What is 123 + 45 + 678?"
    assert task.make(123, 45, 1, (678,))["messages"][0]["content"] == (
        "Let x = 123, y = 45 and z = 678. What is x + y + z?"
    )
    assert ToolCalc(terms=4, max_calls=4).make(1, 2, 1, (3, 4))["messages"][0]["content"] == (
        "Let x = 1, y = 2, z = 3 and u = 4. What is x + y + z + u?"
    )
    problem = task.make(123, 45, 0, (678,))
    assert task.verify(problem, "The answer is 846.").reward == 1.0
    assert task.verify(problem, "The answer is 168.").reward == 0.0  # the first call's sum


def test_an_answer_that_stops_the_chain_early_is_told_what_it_left_out() -> None:
    """The error of a chain stopped after k calls is its partial sum: the hint names the
    numbers not yet added; any other wrong answer keeps the digit hint."""
    task = ToolCalc(terms=3)
    problem = task.make(523, 565, 0, (326,))
    assert task.verify(problem, "The answer is 1088.") == Verdict(
        0.0, "1088 is the sum of the first 2 numbers only: add 326 to it."
    )
    assert task.verify(problem, "The answer is 1000.").hint == (
        "The answer has 4 digits; the last digit is 4."
    )
    four = ToolCalc(terms=4, max_calls=4).make(1, 2, 0, (3, 4))
    assert ToolCalc(terms=4, max_calls=4).verify(four, "3").hint == (
        "3 is the sum of the first 2 numbers only: add 3 and then 4 to it."
    )
    two = ToolCalc().make(523, 565)  # two terms: a first term alone is not a partial chain
    assert ToolCalc().verify(two, "523").hint.startswith("The answer has 4 digits")


def test_a_three_term_demonstration_chains_its_calls_through_the_environment() -> None:
    """Each call adds the next term to the last result, the tool answers each (the
    environment ran them), and the answer is the sum."""
    task = ToolCalc(terms=3)
    record = task.demonstration(task.make(123, 45, 0, (678,)))
    calls = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert calls == [
        '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 45}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 168, "b": 678}}</tool_call>',
        "The answer is 846.",
    ]
    assert [m["content"] for m in record["messages"] if m["role"] == "tool"] == ["168", "846"]
    assert record["reward"] == 1.0 and [t["function"]["name"] for t in record["tools"]] == ["add"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_value": 50, "max_value": 10}, "got 50, 10"),
        ({"xy_share": 1.5}, "xy_share must be in \\[0, 1\\], got 1.5"),
        ({"terms": 1}, "terms must be an integer in \\[2, 6\\], got 1"),
        ({"terms": 7}, "got 7"),
        ({"terms": 4}, "terms=4 takes 3 calls and an answer, so max_calls must be >= 4.*got 3"),
    ],
)
def test_bad_settings_name_the_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ToolCalc(**kwargs)

"""Verifiers, hints, the task lookup and the verifier-backed providers, on hand examples."""

from __future__ import annotations

import random

import pytest

from composer_lightning.tasks import (
    Arithmetic,
    FunctionScore,
    ReverseDigits,
    ScoringError,
    Task,
    Verdict,
    VerifierHint,
    VerifierScore,
    get_task,
)
from composer_lightning.tasks.arithmetic import first_integer


def test_arithmetic_problem_shape_and_determinism() -> None:
    task = Arithmetic(min_value=3, max_value=9, ops=("+", "-", "*"))
    a, b = task.samples(20, seed=1), task.samples(20, seed=1)
    assert a == b
    for p in a:
        assert p["task"] == "arithmetic"
        assert p["messages"][0]["role"] == "user"
        assert 3 <= p["a"] <= 9 and 3 <= p["b"] <= 9
        assert int(p["answer"]) >= 0  # allow_negative=False orders "-" operands
        assert task.verify(p, p["answer"]).reward == 1.0


@pytest.mark.parametrize(
    ("completion", "reward", "hint"),
    [
        ("27", 1.0, None),
        ("The answer is 27.", 1.0, None),
        ("27 or maybe 28", 1.0, None),  # the FIRST integer counts
        ("28", 0.0, "The answer has 2 digits; the last digit is 7."),  # last digit wrong
        ("37", 0.0, "The answer has 2 digits; the first digit is 2."),  # only the tens wrong
        ("7", 0.0, "The answer has 2 digits; the first digit is 2."),  # forgot the carry
        ("127", 0.0, "The answer has 2 digits; the first digit is 2."),  # only length wrong
        ("-27", 0.0, "The answer has 2 digits; the first digit is 2."),  # only sign wrong
        ("no idea", 0.0, "Reply with a number. The answer has 2 digits; the last digit is 7."),
    ],
)
def test_arithmetic_verifier(completion: str, reward: float, hint: str | None) -> None:
    problem = Arithmetic().make(20, "+", 7)
    assert problem["answer"] == "27"
    assert Arithmetic().verify(problem, completion) == Verdict(reward, hint)


def test_arithmetic_negative_and_middle_digit_hints() -> None:
    task = Arithmetic(ops=("-",), allow_negative=True)
    assert task.verify(task.make(3, "-", 8), "5").hint == (
        "The answer is negative; the answer has 1 digit; the last digit is 5."
    )
    mul = Arithmetic(max_value=99, ops=("*",)).make(23, "*", 11)  # 253
    assert mul["answer"] == "253"
    assert Arithmetic().verify(mul, "263").hint == (
        "The answer has 3 digits; digit 2 (from the left) is 5."
    )
    assert first_integer("x=-4, 5") == -4


def test_arithmetic_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ops"):
        Arithmetic(ops=("/",))
    with pytest.raises(ValueError, match="min_value"):
        Arithmetic(min_value=5, max_value=1)


def test_reverse_verifier_and_partial_credit() -> None:
    task = ReverseDigits()
    p = task.make("4719")
    assert p["answer"] == "9174"
    assert task.verify(p, "9174") == Verdict(1.0, None)
    assert task.verify(p, "Sure: 9174") == Verdict(1.0, None)
    assert task.verify(p, "9147") == Verdict(0.0, "The answer has 4 digits; digit 3 is 7.")
    assert task.verify(p, "91") == Verdict(0.0, "The answer has 4 digits; digit 3 is 7.")
    assert task.verify(p, "") == Verdict(
        0.0, "Reply with the digits only. The answer has 4 digits; digit 1 is 9."
    )
    partial = ReverseDigits(partial_credit=True)
    q = partial.make("4719")
    assert partial.verify(q, "9147").reward == pytest.approx(2 / 4)  # 9, 1 match
    assert partial.verify(q, "91740").reward == pytest.approx(4 / 5)  # longer guess penalised
    assert partial.verify(q, "9174").reward == 1.0
    lengths = {len(s["digits"]) for s in ReverseDigits(2, 3).samples(50)}
    assert lengths == {2, 3}


def test_get_task_names_paths_and_errors() -> None:
    assert isinstance(get_task("arithmetic"), Arithmetic)
    assert isinstance(get_task("reverse", min_len=2), ReverseDigits)
    assert isinstance(get_task("composer_lightning.tasks.arithmetic.Arithmetic"), Arithmetic)
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arithmetic.*reverse"):
        get_task("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_task("composer_lightning.tasks.arithmetic.Nope")
    with pytest.raises(ValueError, match="not a Task"):
        get_task("random.Random")


class _Exploding(Task):
    """Raises on problems whose answer is "boom"."""

    name = "exploding"

    def sample(self, rng: random.Random) -> dict:
        return {"task": self.name, "messages": [], "answer": "1"}

    def verify(self, problem: dict, completion: str) -> Verdict:
        if problem["answer"] == "boom":
            raise RuntimeError("reward function crashed")
        return Verdict(
            1.0 if completion == problem["answer"] else 0.0,
            None if completion == problem["answer"] else "no",
        )


def test_verifier_providers_look_up_the_task_per_problem() -> None:
    problems = [Arithmetic().make(2, "+", 3), ReverseDigits().make("123")]
    assert VerifierScore().score(problems, ["5", "320"]) == [1.0, 0.0]
    assert VerifierHint().hints(problems, ["5", "311"]) == [
        None,
        "The answer has 3 digits; digit 2 is 2.",
    ]
    assert VerifierScore("arithmetic").score(problems[:1], ["4"]) == [0.0]
    with pytest.raises(ValueError, match="completions"):
        VerifierScore().score(problems, ["5"])


def test_raising_reward_function_gives_none_and_is_counted() -> None:
    task = _Exploding()
    problems = [{"answer": "1"}, {"answer": "boom"}, {"answer": "2"}]
    scorer, hinter = VerifierScore(task), VerifierHint(task)
    assert scorer.score(problems, ["1", "1", "1"]) == [1.0, None, 0.0]
    assert scorer.failures == 1
    assert hinter.hints(problems, ["1", "1", "1"]) == [None, None, "no"]
    assert hinter.failures == 1
    ScoringError.raise_if_all_failed([1.0, None, 0.0], failures=1)  # some usable: no error
    all_bad = scorer.score([{"answer": "boom"}] * 2, ["1", "1"])
    assert all_bad == [None, None] and scorer.failures == 3
    with pytest.raises(ScoringError, match="all 2 score calls"):
        ScoringError.raise_if_all_failed(all_bad, failures=2)


def test_function_score_keeps_any_finite_reward_and_clips_only_when_asked(caplog) -> None:
    """±1 rewards are not [0, 1] rewards: they pass as they are (GRPO needs no range); a failure
    is one warning line (no traceback) and a count."""

    def fn(problem: dict, completion: str) -> float:
        if completion == "raise":
            raise KeyError("x")
        return {"nan": float("nan")}.get(completion, float(completion))

    scorer = FunctionScore(fn)
    with caplog.at_level("WARNING"):
        assert scorer.score([{}] * 5, ["0.5", "2", "-1", "raise", "nan"]) == [
            0.5,
            2.0,
            -1.0,
            None,
            None,
        ]
    assert scorer.failures == 2
    failures = [r for r in caplog.records if "reward function" in r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info is None for r in failures)
    assert "raised on sample 3 (it gets no score): KeyError: 'x'" in failures[0].getMessage()
    assert "returned nan on sample 4, expected a finite number" in failures[1].getMessage()
    clipped = FunctionScore(fn, clip=(0.0, 1.0))
    assert clipped.score([{}] * 3, ["0.5", "2", "-1"]) == [0.5, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"clip must be \(low, high\)"):
        FunctionScore(fn, clip=(1.0, 0.0))


def test_prompt_file_missing_a_verifier_field_is_one_error_naming_file_and_line(tmp_path) -> None:
    from composer_lightning.datamodules.rollout import RolloutDataModule

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "What is 2 + 3?", "answer": 5}\n{"prompt": "What is 4 + 4?"}\n')
    with pytest.raises(
        ValueError,
        match=r"prompts.jsonl:2: the 'arithmetic' verifier needs field\(s\) \['answer'\]",
    ):
        RolloutDataModule(tokenizer=None, task="arithmetic", prompt_file=str(path))
    path.write_text(
        '{"prompt": "x", "answer": 5, "task": "reverse"}\n{"prompt": "y", "task": "nope"}\n'
    )
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: unknown task 'nope'"):
        RolloutDataModule(tokenizer=None, task="arithmetic", prompt_file=str(path))


def test_verdict_rejects_out_of_range_reward() -> None:
    with pytest.raises(ValueError):
        Verdict(1.5)


def test_hint_candidates_the_verifier_hint_first_then_the_other_digits() -> None:
    from composer_lightning.runtime.calls import as_hint, hint_candidates
    from composer_lightning.tasks import VerifierHint

    task = Arithmetic(max_value=999)
    p = task.make(517, "+", 38)  # 555
    assert task.hint_candidates(p, "545", 3) == [
        "The answer has 3 digits; digit 2 (from the left) is 5.",
        "The answer has 3 digits; the last digit is 5.",
        "The answer has 3 digits; the first digit is 5.",
    ]
    assert task.hint_candidates(p, "555", 3) == []
    assert task.hint_candidates(p, "545", 1) == [task.verify(p, "545").hint]
    hints = VerifierHint(task, candidates=2).hints([p, p], ["545", "555"])
    assert hints == [task.hint_candidates(p, "545", 2), None]
    assert VerifierHint(task).hints([p], ["545"]) == [task.verify(p, "545").hint]
    assert as_hint([]) is None and as_hint(("a", "b")) == ["a", "b"]
    assert hint_candidates(["a", "b", "a"]) == ["a", "b"] and hint_candidates("a") == ["a"]
    with pytest.raises(ValueError, match="candidates must be an integer >= 1, got 0"):
        VerifierHint(candidates=0)


def test_the_answer_hint_states_the_reference_answer_of_a_wrong_reply_only(caplog) -> None:
    from composer_lightning.tasks import AnswerHint

    problems = [
        {"task": "chat_arithmetic", "prompt": "What is 17 + 25?", "answer": 42},
        {"task": "chat_arithmetic", "prompt": "What is 17 + 25?", "answer": 42},
        {"task": "chat_arithmetic", "prompt": "What is 3 + 4?", "answer": 7},
    ]
    replies = ["17 + 25 = 32.", "So 17 + 25 is 42.", "The sum is 7."]
    assert AnswerHint().hints(problems, replies) == ["The correct answer is 42.", None, None]
    custom = AnswerHint(template="It is {answer}, not what you wrote.")
    assert custom.hints(problems[:1], replies[:1]) == ["It is 42, not what you wrote."]
    broken = AnswerHint(template="The solution is {solution}.")  # a field no problem has
    with caplog.at_level("WARNING"):
        assert broken.hints(problems[:1], replies[:1]) == [None]
    assert broken.failures == 1 and "KeyError" in caplog.text

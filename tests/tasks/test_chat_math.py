"""Chat arithmetic, sums and word problems: the answer is where a chat model puts it (by hand)."""

from __future__ import annotations

import pytest

from composer_lightning.tasks import get_task
from composer_lightning.tasks.chat_math import (
    ChatAnswerLine,
    ChatArithmetic,
    ChatBoxed,
    ChatSums,
    ChatTagged,
    WordProblems,
    boxed_integer,
    final_integer,
)


@pytest.mark.parametrize(
    "reply,expected",
    [
        ("12 + 32 = 44.", 44),  # the last number, not the first (12)
        ("To add 7 and 6, count on from 7: 7 + 6 equals 13.", 13),
        ("The total is 1,234 apples.", 1234),  # digit groups
        ("So the answer is \\boxed{13}. Check: 13 + 1 = 14", 13),  # a boxed answer wins
        ("\\boxed{x = -5}", -5),
        ("It is negative: -7", -7),
        ("No idea.", None),
        ("12, 345", 345),  # a comma and a space: two numbers
    ],
)
def test_the_final_integer_of_a_reply(reply, expected):
    assert final_integer(reply) == expected


def test_chat_arithmetic_scores_the_final_number_and_hints_the_wrong_digit():
    task = ChatArithmetic()
    problem = task.make(17, "+", 25)  # 42
    assert problem["task"] == "chat_arithmetic" and problem["answer"] == "42"
    assert task.verify(problem, "17 + 25 = 42.").reward == 1.0
    assert task.verify(problem, "The answer is 42, since 17 + 25 = 42.").reward == 1.0
    wrong = task.verify(problem, "17 + 25 = 32.")  # the first digit is wrong: 3 vs 4
    assert wrong.reward == 0.0 and wrong.hint == "The answer has 2 digits; the first digit is 4."
    wrong = task.verify(problem, "17 + 25 = 43.")  # the last digit is wrong
    assert wrong.hint == "The answer has 2 digits; the last digit is 2."
    none = task.verify(problem, "I cannot add.")
    assert none.hint == "Reply with a number. The answer has 2 digits; the last digit is 2."
    assert task.hint_candidates(problem, "17 + 25 = 43.", 2) == [
        "The answer has 2 digits; the last digit is 2.",
        "The answer has 2 digits; the first digit is 4.",
    ]
    assert task.hint_candidates(problem, "42", 2) == []


def test_chat_arithmetic_draws_two_digit_operands_by_default():
    problems = ChatArithmetic().samples(200, seed=1)
    operands = [p["a"] for p in problems] + [p["b"] for p in problems]
    assert min(operands) >= 10 and max(operands) <= 49
    assert all(int(p["answer"]) == p["a"] + p["b"] for p in problems)


def test_word_problems_answer_a_plus_b_minus_c():
    task = WordProblems()
    problem = task.make("Tom", "He", "apples", 29, 13, 4)
    assert problem["messages"][0]["content"] == (
        "Tom has 29 apples. He buys 13 more and gives away 4. How many apples does Tom have now?"
    )
    assert problem["answer"] == "38"
    assert task.verify(problem, "29 + 13 = 42, and 42 - 4 = 38. Tom has 38 apples.").reward == 1.0
    # 42 against 38: both digits wrong, the hint names the rightmost (where carries start)
    assert task.verify(problem, "Tom has 42 apples.").hint == (
        "The answer has 2 digits; the last digit is 8."
    )
    for p in task.samples(200, seed=2):
        assert int(p["answer"]) >= 0


def test_chat_boxed_reads_the_answer_only_from_the_box():
    task = ChatBoxed()
    problem = task.make(17, "+", 25)
    assert problem["messages"][0]["content"] == (
        "What is 17 + 25? Put your final answer within \\boxed{}."
    )
    assert task.verify(problem, "17 + 25 = \\boxed{42}").reward == 1.0
    assert task.verify(problem, "\\boxed{40}? No: 17 + 25 = \\boxed{42}.").reward == 1.0
    unboxed = task.verify(problem, "17 + 25 = 42.")  # right, but not where it was asked for
    assert (unboxed.reward, unboxed.hint) == (
        0.0,
        "Work it out, then end the reply with the answer in \\boxed{}.",
    )
    assert task.verify(problem, "\\boxed{}  so 42").reward == 0.0  # an empty box holds nothing
    wrong = task.verify(problem, "17 + 25 = \\boxed{32}")
    assert (wrong.reward, wrong.hint) == (0.0, "The answer has 2 digits; the first digit is 4.")
    assert task.hint_candidates(problem, "17 + 25 = 42.", 2) == [unboxed.hint]
    assert task.hint_candidates(problem, "\\boxed{43}", 1) == [
        "The answer has 2 digits; the last digit is 2."
    ]
    assert boxed_integer("\\boxed{1,234} and 7") == 1234
    assert boxed_integer("\\boxed{x} then 7") is None


def test_chat_tagged_reads_the_answer_only_between_the_tags():
    task = ChatTagged()
    problem = task.make(17, "+", 25)
    assert problem["messages"][0]["content"] == (
        "What is 17 + 25? Give the final answer between <answer> and </answer>."
    )
    assert task.verify(problem, "17 + 25 = 42, so <answer>42</answer>").reward == 1.0
    assert task.verify(problem, "<answer> 1,042 </answer>").hint is not None  # read: 1042
    assert task.verify(problem, "<answer>40</answer>? No: <answer>42</answer>").reward == 1.0
    untagged = task.verify(problem, "17 + 25 = 42.")  # right, but not where it was asked for
    assert (untagged.reward, untagged.hint) == (
        0.0,
        "Work it out, then end the reply with the answer between <answer> and </answer>.",
    )
    assert task.verify(problem, "<answer>42").reward == 0.0  # an unclosed tag holds nothing
    assert task.verify(problem, "\\boxed{42}").reward == 0.0  # another form is not this one
    wrong = task.verify(problem, "<answer>32</answer>")
    assert (wrong.reward, wrong.hint) == (0.0, "The answer has 2 digits; the first digit is 4.")
    assert task.hint_candidates(problem, "17 + 25 = 42.", 2) == [untagged.hint]
    assert task.guess("<answer>x</answer> then 7") is None


def test_chat_answer_line_reads_the_answer_only_after_the_marker():
    task = ChatAnswerLine()
    problem = task.make(17, "+", 25)
    assert problem["messages"][0]["content"] == (
        "What is 17 + 25? End your reply with 'ANSWER: <number>'."
    )
    assert task.verify(problem, "17 + 25 = 42\nANSWER: 42").reward == 1.0
    assert task.verify(problem, "ANSWER: 40\nNo: ANSWER: 42.").reward == 1.0  # the last one
    unmarked = task.verify(problem, "17 + 25 = 42. The answer: 42")  # not the asked marker
    assert (unmarked.reward, unmarked.hint) == (
        0.0,
        "Work it out, then end the reply with 'ANSWER: <number>'.",
    )
    assert task.verify(problem, "ANSWER:\n42").reward == 0.0  # the number on the marker's line
    wrong = task.verify(problem, "ANSWER: 32")
    assert (wrong.reward, wrong.hint) == (0.0, "The answer has 2 digits; the first digit is 4.")
    with pytest.raises(ValueError, match=r"chat_answer_line: the template must ask .* in ANSWER:"):
        ChatAnswerLine(template="What is {a} {op} {b}?")


def test_chat_sums_answer_the_sum_of_every_term():
    task = ChatSums()
    problem = task.make([13, 27, 15])
    assert problem["messages"][0]["content"] == "What is 13 + 27 + 15?"
    assert problem["answer"] == "55" and problem["task"] == "chat_sums"
    assert task.verify(problem, "13 + 27 = 40, and 40 + 15 = 55.").reward == 1.0
    assert task.verify(problem, "13 + 27 + 15 = 45.").hint == (
        "The answer has 2 digits; the first digit is 5."
    )
    four = ChatSums(terms=4, min_value=1, max_value=9).samples(200, seed=3)
    for p in four:
        terms = [int(t) for t in p["messages"][0]["content"][8:-1].split(" + ")]
        assert len(terms) == 4 and all(1 <= t <= 9 for t in terms)
        assert int(p["answer"]) == sum(terms)


def test_every_chat_task_is_found_by_name_and_verifies_any_of_its_problems():
    named = (  # each with a right reply in the form it reads
        ("chat_arithmetic", ChatArithmetic, "{}"),
        ("chat_boxed", ChatBoxed, "\\boxed{{{}}}"),
        ("chat_tagged", ChatTagged, "<answer>{}</answer>"),
        ("chat_answer_line", ChatAnswerLine, "ANSWER: {}"),
        ("chat_sums", ChatSums, "{}"),
        ("word_problems", WordProblems, "{}"),
    )
    for name, cls, reply in named:
        task = get_task(name)
        assert isinstance(task, cls)
        problem = task.samples(1, seed=0)[0]
        verdict = get_task(problem["task"]).verify(problem, reply.format(problem["answer"]))
        assert verdict.reward == 1.0


def test_bad_ranges_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"given must be a range 0 <= low <= high, got \(5, 1\)"):
        WordProblems(given=(5, 1))
    with pytest.raises(ValueError, match=r"chat_boxed: the template must ask .* got 'What is"):
        ChatBoxed(template="What is {a} {op} {b}?")
    with pytest.raises(ValueError, match=r"chat_tagged: the template must ask for the answer in"):
        ChatTagged(template="What is {a} {op} {b}? Box it: \\boxed{{}}.")
    with pytest.raises(ValueError, match=r"chat_sums: terms must be an integer >= 2, got 1"):
        ChatSums(terms=1)
    with pytest.raises(ValueError, match=r"chat_sums: need 0 <= min_value <= max_value, got 9, 1"):
        ChatSums(min_value=9, max_value=1)

"""Explicit-feedback next-state judges: the user's reply says right or wrong, and how to fix."""

import pytest

from composer_lightning.tasks.feedback import FeedbackHint, FeedbackScore


def _turn(reply, role="user"):
    return {"messages": [], "next_state": [{"role": role, "content": reply}]}


@pytest.mark.parametrize(
    ("reply", "score", "hint"),
    [
        ("No, that is wrong. Hint: the answer has 2 digits.", -1.0, "the answer has 2 digits."),
        ("Correct, thanks.", 1.0, None),
        ("Hint: carry the one.", None, "carry the one."),
        ("Ok.", None, None),
        ("Nothing to say", None, None),  # "no" only as a whole word
        ("not quite. hint:  try again ", -1.0, "try again"),
        ("Thanks.", None, None),  # politeness, not a verdict: said after wrong answers too
        ("No. Hint: it is even.\nNow, what is 3 + 4?", -1.0, "it is even."),  # to the line's end
        ("Hint:\nsomething", None, None),
    ],
)
def test_the_reply_gives_a_plus_or_minus_one_score_and_the_text_after_the_marker(
    reply, score, hint
):
    assert FeedbackScore().score([_turn(reply)], ["x"]) == [score]
    assert FeedbackHint().hints([_turn(reply)], ["x"]) == [hint]


def test_a_turn_without_a_next_state_gets_nothing():
    last = {"messages": [], "next_state": []}
    assert FeedbackScore().score([last], ["x"]) == [None]
    assert FeedbackHint().hints([last], ["x"]) == [None]
    with pytest.raises(ValueError, match="non-empty marker"):
        FeedbackHint("")

"""The four-way dispatch as a pure decision (DESIGN.md): a score gives RL, a hint gives OPD."""

from composer_lightning.dispatch import dispatch


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

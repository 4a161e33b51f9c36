"""The RolloutBatch contract's shape checks."""

import pytest
import torch

from composer_lightning.protocols.batch import RolloutBatch


def _kw(**over):
    B, T = 2, 5
    kw = dict(
        input_ids=torch.ones(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T),
        response_mask=torch.ones(B, T, dtype=torch.bool),
        rewards=torch.zeros(B),
        has_reward=torch.ones(B, dtype=torch.bool),
        group_ids=torch.zeros(B, dtype=torch.long),
        max_response_length=4,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,match",
    [
        (
            dict(response_mask=torch.ones(2, 4, dtype=torch.bool)),
            r"response_mask has shape \(2, 4\); expected \(2, 5\)",
        ),
        (dict(rewards=torch.zeros(3)), r"rewards has shape \(3,\); expected \(2,\)"),
        (dict(has_teacher=torch.ones(2, dtype=torch.bool)), "teacher_input_ids is None"),
        (dict(max_response_length=0), "max_response_length must be > 0"),
        (dict(teacher_input_ids=torch.ones(2, 7, dtype=torch.long)), "teacher_positions is None"),
    ],
)
def test_contract_violations_name_the_field(over, match):
    with pytest.raises(ValueError, match=match):
        RolloutBatch(**_kw(**over))


def test_select_keeps_rows_and_defaults():
    b = RolloutBatch(**_kw())
    assert b.has_teacher.tolist() == [False, False] and not b.sdpo_mask.any()
    sub = b.select(torch.tensor([1]))
    assert sub.batch_size == 1 and sub.max_response_length == 4

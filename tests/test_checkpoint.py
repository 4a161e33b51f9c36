"""The module's part of a checkpoint, in one process: per-rank state (a list of one rank here),
the layout of older checkpoints, another number of ranks, and the RNGs set again when training
starts. Two ranks: tests/scale/test_resume.py."""

from __future__ import annotations

import random

import pytest
import torch

from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.training.module import ComposerModule
from tests.helpers import tiny_model


def _module() -> ComposerModule:
    module = ComposerModule(
        tiny_model(torch.float32), [DrGRPOHead(), ReplayDPOHead(capacity=8)], max_logprob_gap=None
    )
    module.heads[1]._add({"chosen": torch.tensor([1, 2, 3]), "rejected": torch.tensor([1, 2])})
    module.policy_version = 3
    return module


def test_state_is_saved_per_rank_and_the_version_once():
    checkpoint: dict = {}
    _module().on_save_checkpoint(checkpoint)
    state = checkpoint["composer"]
    assert state["policy_version"] == 3 and len(state["ranks"]) == 1
    (mine,) = state["ranks"]
    assert set(mine) == {"heads", "rng"} and len(mine["heads"]["replay_dpo"]["buffer"]) == 1


def test_a_checkpoint_of_the_layout_before_per_rank_state_still_loads():
    saved = _module()
    state = {
        "policy_version": 3,
        "heads": {h.name: h.state_dict() for h in saved.heads},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    expected = (torch.rand(3), random.random())
    resumed = ComposerModule(
        tiny_model(torch.float32), [DrGRPOHead(), ReplayDPOHead()], max_logprob_gap=None
    )
    resumed.on_load_checkpoint({"composer": state})
    assert resumed.policy_version == 3
    assert torch.equal(resumed.heads[1].buffer[0]["chosen"], torch.tensor([1, 2, 3]))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_resuming_with_another_number_of_ranks_is_one_configuration_error():
    checkpoint: dict = {}
    _module().on_save_checkpoint(checkpoint)
    checkpoint["composer"]["ranks"] *= 2  # as if written by two ranks
    with pytest.raises(ConfigError, match="per-rank state of 2 ranks, this run has 1: resume"):
        _module().on_load_checkpoint(checkpoint)


def test_the_rngs_are_set_again_when_training_starts():
    """Lightning draws from the global RNGs between restoring a checkpoint and the first step
    (the train loader's iterator seeds itself): the saved states are set again there."""
    module = _module()
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    expected = (torch.rand(3), random.random())
    module.on_load_checkpoint(checkpoint)
    torch.rand(5), random.random()  # what happens between the restore and `on_train_start`
    module.on_train_start()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    module.on_train_start()  # once only: a later fit of the same module is not rewound
    assert not torch.equal(torch.rand(3), expected[0])

"""JSONL inputs: a bad line is one error naming the file and the line."""

from __future__ import annotations

import pytest

from composer_lightning.datamodules.rollout import RolloutDataModule


def test_non_utf8_bytes_in_a_prompt_file_name_the_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(
        b'{"prompt": "1+2=", "answer": 3}\n\n{"prompt": "caf\xe9 1+1=", "answer": 2}\n'
    )
    with pytest.raises(ValueError) as err:
        RolloutDataModule(tokenizer=None, task="arithmetic", prompt_file=str(path))
    assert str(err.value) == (
        f"{path}:3: not UTF-8 text (byte 0xe9 at byte 16 of the line); save the file as UTF-8"
    )

"""Prompts as TRL users have them: standard and conversational rows, `datasets` files with a
column mapping, extra columns kept for the reward functions, TRL's `max_prompt_length`."""

from __future__ import annotations

import json

import pytest

from composer_lightning.chat import tokenize_prompt
from composer_lightning.datamodules.prompts import truncate_left
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.validation import is_heldout

POLICY = tiny_policy_path()


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """Nothing may reach the network; datasets' cache stays in the test's directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def gsm8k_parquet(path, n: int = 40) -> str:
    """A GSM8K-shaped parquet file: `question`, `answer` ending in `#### <number>`."""
    import datasets

    rows = {
        "question": [f"Tom has {i} apples and buys {i + 2} more. How many now?" for i in range(n)],
        "answer": [
            f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2}" for i in range(n)
        ],
    }
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    return str(path)


def test_a_parquet_dataset_with_a_column_mapping_keeps_its_extra_columns(tmp_path):
    path = gsm8k_parquet(tmp_path / "gsm8k.parquet")
    dm = RolloutDataModule(
        tokenizer=POLICY,
        task=None,
        dataset=path,
        columns={"question": "prompt", "answer": "solution"},
        prompts_per_step=4,
    )
    batch = dm.prompt_batch(0)
    assert all(set(p) == {"prompt", "solution"} for p in batch.problems)
    assert all(p["solution"].split("#### ")[1] for p in batch.problems)
    assert batch.prompt_ids[0] == tokenize_prompt(dm.tokenizer, batch.problems[0])
    # the held-out split by hash, as for prompt files: disjoint from training, same size rule
    held = dm.validation_problems()
    assert held and all(is_heldout(p, 0.2) for p in held)
    assert not any(is_heldout(p, 0.2) for p in dm.file_problems)
    assert len(held) + len(dm.file_problems) == 40
    where = [w for w, _ in dm.labelled_prompts()]
    assert where[0] == f"{path}[train] row 0" and len(where) == 40


def test_a_dataset_row_without_a_prompt_is_one_error_naming_the_row(tmp_path):
    path = gsm8k_parquet(tmp_path / "gsm8k.parquet", n=3)
    with pytest.raises(ValueError, match=r"gsm8k.parquet\[train\] row 0: needs 'prompt'"):
        RolloutDataModule(tokenizer=POLICY, task=None, dataset=path)  # no column mapping
    with pytest.raises(ValueError, match=r"row 0: the 'arithmetic' verifier needs field\(s\)"):
        RolloutDataModule(
            tokenizer=POLICY,
            task="arithmetic",
            dataset=path,
            columns={"question": "prompt", "answer": "solution"},
        )
    with pytest.raises(ValueError, match="a prompt_file or a dataset, not both"):
        RolloutDataModule(tokenizer=POLICY, prompt_file=path, dataset=path)


def test_conversational_and_standard_rows_in_one_prompt_file(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"}]
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": chat, "answer": "3"}, {"prompt": "2 + 2?", "answer": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = RolloutDataModule(
        tokenizer=POLICY, task=None, prompt_file=str(path), val_fraction=0.0, prompts_per_step=2
    )
    batch = dm.prompt_batch(0)
    by_prompt = {
        str(p["prompt"]): ids for p, ids in zip(batch.problems, batch.prompt_ids, strict=True)
    }
    assert by_prompt[str(chat)] == tokenize_prompt(dm.tokenizer, {"messages": chat})
    assert dm.tokenizer.decode(by_prompt["2 + 2?"]).startswith("<|bos|><|user|>2 + 2?")


def test_max_prompt_length_keeps_the_last_tokens_as_trl_does(tmp_path):
    """TRL 1.16 (`SDPOTrainer._tokenize_prompts`): `prompt_ids = [ids[-max_prompt_length:]
    for ids in prompt_ids]` — a long prompt loses its first tokens, a short one nothing."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "What is 12 + 30 and then 5?"}) + "\n")
    full = RolloutDataModule(tokenizer=POLICY, task=None, prompt_file=str(path), val_fraction=0)
    cut = RolloutDataModule(
        tokenizer=POLICY, task=None, prompt_file=str(path), val_fraction=0, max_prompt_length=5
    )
    ids = full.prompt_batch(0).prompt_ids[0]
    assert len(ids) > 5
    assert cut.prompt_batch(0).prompt_ids[0] == ids[-5:]  # TRL's definition
    assert [ids for _, ids in cut.labelled_prompts()] == [ids[-5:]]
    assert truncate_left([1, 2, 3], 5) == [1, 2, 3] and truncate_left([1, 2, 3], None) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        RolloutDataModule(tokenizer=POLICY, prompt_file=str(path), max_prompt_length=0)


def test_a_dataset_object_trains_and_a_held_out_set_of_ones_own_validates(tmp_path, caplog):
    """TRL's `train_dataset` / `eval_dataset`: a `Dataset` object is the training data, and
    `val_path` (a JSONL file, a data file or a `Dataset`) the whole held-out set; nothing of
    the training rows is held out then."""
    import datasets

    train = datasets.Dataset.from_list(
        [{"prompt": f"{i} + 1 =", "answer": i + 1} for i in range(30)]
    )
    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join(json.dumps({"prompt": f"{i} + 2 =", "answer": i + 2}) + "\n" for i in range(5))
    )
    for val_path in (
        str(held),
        datasets.Dataset.from_list([json.loads(x) for x in held.read_text().splitlines()]),
    ):
        with caplog.at_level("INFO"):
            dm = RolloutDataModule(
                tokenizer=POLICY,
                dataset=train,
                val_path=val_path,
                val_prompts=4,
                prompts_per_step=2,
            )
        assert len(dm.file_problems) == 30  # every training row trains
        assert [p["prompt"] for p in dm.validation_problems()] == [f"{i} + 2 =" for i in range(4)]
        assert all(p["task"] == "arithmetic" for p in dm.validation_problems())
        assert not any("held out" in r.getMessage() for r in caplog.records)
    assert next(dm.labelled_prompts())[0] == "Dataset object row 0"


def test_a_split_says_in_one_line_how_many_rows_it_holds_out_and_uses(tmp_path, caplog):
    path = gsm8k_parquet(tmp_path / "gsm8k.parquet", n=300)
    with caplog.at_level("INFO"):
        dm = RolloutDataModule(
            tokenizer=POLICY,
            task=None,
            dataset=path,
            columns={"question": "prompt", "answer": "solution"},
            val_prompts=16,
        )
    held = 300 - len(dm.file_problems)
    lines = [r.getMessage() for r in caplog.records if "held out" in r.getMessage()]
    assert lines == [
        f"data: {held} of 300 rows of {path} held out for validation (val_fraction=0.2); the "
        f"held-out set is 16 of them (val_prompts=16), {held - 16} are neither trained nor "
        "validated on; data.val_path gives a held-out set of your own"
    ]

"""A TRL user's run through the real CLI: a GSM8K-shaped parquet file, TRL-style reward functions
by dotted path (open-r1's math accuracy + a format reward, with `reward_weights`), and a base
model without a chat template (plain-text prompts, the hint before the prompt text)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.datamodules.test_prompts import gsm8k_parquet
from tests.helpers import base_model_dir, run_cli

pytestmark = pytest.mark.slow  # fits through the command line

REWARDS = """
import json, os

def format_reward(prompts, completions, solution, completion_ids, **kwargs):
    with open(os.environ["SEEN_KWARGS"], "a") as f:
        f.write(json.dumps({"kwargs": sorted(kwargs), "solution": solution[0],
                            "n": len(completions), "ids": len(completion_ids)}) + "\\n")
    return [1.0 if c.strip() else 0.0 for c in completions]
"""


def _config(tmp_path, score: dict, data: dict, heads: list[str], hint: dict | None) -> str:
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False},
        "rollout": {
            "class_path": "composer_lightning.rollout.callback.RolloutCallback",
            "init_args": {
                "engine": {"class_path": "composer_lightning.engines.HFEngine"},
                "group_size": 2,
                "sampling": {"temperature": 1.0, "max_tokens": 6, "seed": 0},
                "score": score,
                "hint": hint,
            },
        },
        "model": {"heads": [{"class_path": h} for h in heads]},
        "data": {
            "class_path": "composer_lightning.datamodules.rollout.RolloutDataModule",
            "init_args": {"prompts_per_step": 2, **data},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _fit(tmp_path, config: str, policy: str, pythonpath: str | None = None, **env: str):
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    os.environ.update(env)
    try:
        return run_cli(
            "fit",
            "--config",
            config,
            f"--model.policy={policy}",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
            pythonpath=pythonpath,
        )
    finally:
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME", *env):
            os.environ.pop(key, None)


def test_gsm8k_parquet_with_trl_reward_functions_trains_through_the_cli(tmp_path):
    from composer_lightning.models.tiny import tiny_policy_path

    (tmp_path / "my_rewards.py").write_text(REWARDS)
    seen = tmp_path / "seen.jsonl"
    score = {
        "class_path": "composer_lightning.tasks.FunctionScore",
        "init_args": {
            "fn": ["composer_lightning.tasks.math.accuracy_reward", "my_rewards.format_reward"],
            "reward_weights": [1.0, 0.5],
        },
    }
    data = {
        "task": None,
        "dataset": gsm8k_parquet(tmp_path / "gsm8k.parquet"),
        "columns": {"question": "prompt", "answer": "solution"},
        "max_prompt_length": 64,
    }
    config = _config(tmp_path, score, data, ["composer_lightning.heads.dr_grpo.DrGRPOHead"], None)
    out = _fit(tmp_path, config, tiny_policy_path(), str(tmp_path), SEEN_KWARGS=str(seen))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "reward function" not in out.stderr  # no call failed
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(calls) >= 2  # one batched call per rollout batch (and validation)
    assert calls[0]["n"] == calls[0]["ids"] == 4 and "#### " in calls[0]["solution"]
    assert calls[0]["kwargs"] == ["log_extra", "log_metric", "trainer_state"]  # as TRL 1.16
    # the run's saved config, reward functions included, runs again as it is
    saved = tmp_path / "run" / "config.yaml"
    assert "my_rewards.format_reward" in saved.read_text()
    again = run_cli(
        "validate",
        "--config",
        str(saved),
        "--trainer.limit_val_batches=1",
        pythonpath=str(tmp_path),
        env={"SEEN_KWARGS": str(seen), "HF_HOME": str(tmp_path / "hf")},
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "val/accuracy" in again.stdout


def test_a_base_model_without_a_chat_template_trains_with_hints(tmp_path):
    """Arithmetic prompts as plain text; verifier hints before the prompt text feed the
    OPD and SDPO teacher."""
    heads = [
        "composer_lightning.heads.dr_grpo.DrGRPOHead",
        "composer_lightning.heads.opd.OPDHead",
        "composer_lightning.heads.sdpo.SDPOHead",
    ]
    config = _config(
        tmp_path,
        {"class_path": "composer_lightning.tasks.VerifierScore"},
        {"task": "arithmetic"},
        heads,
        {"class_path": "composer_lightning.tasks.VerifierHint"},
    )
    out = _fit(tmp_path, config, base_model_dir(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "chat template" not in out.stderr

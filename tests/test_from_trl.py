"""docs/from_trl.md names every field TRL's `GRPOConfig` declares, once, and every option path
it gives exists here: a TRL release that adds a field, or a renamed option, fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from tests.helpers import ROOT

PAGE = ROOT / "docs" / "from_trl.md"
ROW = re.compile(r"^\| `(?P<field>\w+)` \| (?P<here>[^|]+) \|", re.MULTILINE)


def _rows() -> dict[str, str]:
    rows = [(m["field"], m["here"].strip()) for m in ROW.finditer(PAGE.read_text())]
    fields = [f for f, _ in rows]
    assert len(fields) == len(set(fields)), "a field is named twice"
    return dict(rows)


def test_the_page_names_every_field_of_trls_grpo_config():
    trl = pytest.importorskip("trl", reason="trl not installed (pip install -e .[bench])")
    declared = list(trl.GRPOConfig.__annotations__)  # its own, not TrainingArguments'
    rows = _rows()
    assert [f for f in declared if f not in rows] == []
    assert [f for f in rows if f not in declared] == []


def _options(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def test_every_option_path_on_the_page_exists():
    """`model.x`, `rollout.x`, `rollout.sampling.x`, `rollout.engine.x`, `data.x` and
    `<head>.x` name arguments of the classes they stand for."""
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import SamplingConfig, VLLMEngine
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.heads.kl import KLHead
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.training.entropy import AdaptiveEntropy
    from composer_lightning.training.module import ComposerModule

    owners = {
        "model": ComposerModule,
        "rollout": RolloutCallback,
        "rollout.sampling": SamplingConfig,
        "rollout.engine": VLLMEngine,
        "data": RolloutDataModule,
        "dr_grpo": DrGRPOHead,
        "kl": KLHead,
        "model.adaptive_entropy": AdaptiveEntropy,
    }
    paths = re.findall(r"`((?:model|rollout|data|dr_grpo|kl)(?:\.\w+)+)`", PAGE.read_text())
    assert len(paths) > 30
    for path in paths:
        owner, _, option = path.rpartition(".")
        if owner == "model.optimizer.init_args":  # the optimizer's own arguments
            continue
        if owner not in owners:
            owner, option = path.split(".")[0], path.split(".")[1]
        assert option in _options(owners[owner]), path
    assert len(_rows()) == 79  # TRL 1.16's count, checked without trl installed


def reward_len(completions, **kwargs):
    """A TRL-style batched reward function (the converter's test names it by dotted path)."""
    return [min(len(c), 8) / 8 for c in completions]


TRL_YAML = """
model_name_or_path: {policy}
dataset_name: {data}
dataset_train_split: train
reward_funcs: [tests.test_from_trl.reward_len]
reward_weights: [0.5]
learning_rate: 1.0e-5
num_generations: 4
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
max_completion_length: 16
temperature: 0.9
beta: 0.04
epsilon: 0.2
epsilon_high: 0.28
loss_type: dr_grpo
scale_rewards: false
num_iterations: 2
max_steps: 3
logging_steps: 1
seed: 7
output_dir: {out}
eval_steps: 2
use_cpu: true
bf16: false
log_completions: true
min_p: 0.1
top_k: 20
repetition_penalty: 1.1
generation_kwargs: {{no_repeat_ngram_size: 3}}
chat_template_kwargs: {{enable_thinking: false}}
attn_implementation: eager
sync_ref_model: true
ref_model_sync_steps: 2
importance_sampling_level: sequence
delta: 1.5
top_entropy_quantile: 0.5
off_policy_mask_threshold: 0.4
multi_objective_aggregation: normalize_then_sum
use_adaptive_entropy: true
entropy_target: 0.5
vespo_k_pos: 2.0
report_to: none
"""


@pytest.mark.slow  # a validate run through the command line
def test_a_trl_config_converts_and_validates(tmp_path):
    """~30 fields of a TRL GRPO config: each carried to the option the page names (the batch
    shape, the loss, the KL head, the clip, the rewards), each of the others one comment line;
    `validate` runs the converted config."""
    import json

    from composer_lightning.models.tiny import tiny_policy_path
    from tests.helpers import run_cli

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(60))
    )
    trl = tmp_path / "grpo.yaml"
    trl.write_text(TRL_YAML.format(policy=tiny_policy_path(), data=data, out=tmp_path / "run"))
    out = run_cli("from-trl", str(trl))
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stdout.splitlines() if line.startswith("# not carried: ")]
    assert [n.split(":")[1].strip() for n in notes] == ["vespo_k_pos"]
    import yaml

    config = yaml.safe_load(out.stdout)
    model, rollout = config["model"], config["rollout"]["init_args"]
    assert config["data"]["init_args"]["prompts_per_step"] == 4  # 8 × 2 completions / G = 4
    assert (model["minibatches"], model["micro_batch_size"], model["ppo_epochs"]) == (1, 8, 2)
    assert (model["aggregation"], model["norm_length"]) == ("token_sum_norm", 16)
    assert (model["clip_low"], model["clip_high"], model["dual_clip"]) == (0.2, 0.28, 1.5)
    assert model["importance_sampling_level"] == "sequence"
    assert (model["top_entropy_quantile"], model["off_policy_mask_threshold"]) == (0.5, 0.4)
    assert (model["ref_model_sync_steps"], model["ref_model_mixup_alpha"]) == (2, 0.6)
    assert model["model_init_kwargs"] == {"attn_implementation": "eager"}
    assert model["adaptive_entropy"] == {"target": 0.5}
    assert config["data"]["init_args"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert model["heads"][0]["init_args"]["scale_rewards"] == "none"
    assert model["heads"][0]["init_args"]["multi_objective_aggregation"] == "normalize_then_sum"
    assert model["heads"][1]["init_args"] == {
        "kl_coef": 0.04,
        "estimator": "k3",
        "placement": "loss",
    }
    assert model["optimizer"]["init_args"] == {"lr": 1e-5}
    assert rollout["group_size"] == 4 and rollout["sampling"] == {
        "temperature": 0.9, "max_tokens": 16, "seed": 7, "top_k": 20, "min_p": 0.1,
        "repetition_penalty": 1.1, "generation_kwargs": {"no_repeat_ngram_size": 3},
    }  # fmt: skip
    assert rollout["score"]["init_args"] == {
        "fn": ["tests.test_from_trl.reward_len"],
        "reward_weights": [0.5],
    }
    converted = tmp_path / "run.yaml"
    converted.write_text(out.stdout)
    checked = run_cli("validate", "--config", str(converted))
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "val/reward_mean" in checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("loss_type", "extra", "want"),
    [
        ("cispo", "epsilon_high: 5.0\n", {"loss_mode": "cispo", "aggregation": "token_mean", "clip_high": 4.0}),
        ("sapo", "sapo_temperature_neg: 2.0\n", {"loss_mode": "sapo", "aggregation": "seq_mean_token_mean", "sapo_temperature_neg": 2.0}),
    ],
)  # fmt: skip
def test_cispo_and_sapo_convert_to_their_loss_modes(tmp_path, loss_type, extra, want):
    import yaml

    from composer_lightning.from_trl import convert

    trl = yaml.safe_load(f"model_name_or_path: m\ndataset_name: d\nloss_type: {loss_type}\n{extra}")
    config, notes = convert(trl)
    assert notes[:1] == [] or "loss_type" not in notes[0]
    assert {k: config["model"][k] for k in want} == want


@pytest.mark.slow  # the command line in a process of its own, per case
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ("dataset_name: x.jsonl\n", "needs model_name_or_path"),
        ("model_name_or_path: m\n", "needs dataset_name"),
        ("model_name_or_path: m\ndataset_name: d\nloss_type: ppo\n", "loss_type 'ppo' is not TRL's; expected one of"),
        ("model_name_or_path: m\ndataset_name: d\nnum_generations: 3\n", "must be whole groups of num_generations = 3"),
        ("model_name_or_path: m\ndataset_name: d\nloss_type: cispo\n", "loss_type cispo caps each token's weight at epsilon_high = 0.2"),
        ("model_name_or_path: m\ndataset_name: d\nimportance_sampling_level: seq\n", "importance_sampling_level 'seq' is not TRL's"),
        ("model_name_or_path: m\ndataset_name: d\nsync_ref_model: true\n", "sync_ref_model: true with beta = 0"),
    ],
)  # fmt: skip
def test_bad_trl_configs_are_one_line_naming_the_field(tmp_path, fields, message):
    from tests.helpers import run_cli

    trl = tmp_path / "grpo.yaml"
    trl.write_text(fields)
    out = run_cli("from-trl", str(trl))
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"composer_lightning from-trl: {trl}: ") and message in line

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
    """The first table's rows (the page's later sections have tables of their own)."""
    table = PAGE.read_text().split("\n## ")[0]
    rows = [(m["field"], m["here"].strip()) for m in ROW.finditer(table)]
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
max_steps: 4
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
    assert model["optimizer"]["init_args"] == {
        "lr": 1e-5, "weight_decay": 0.0, "eps": 1e-8, "betas": [0.9, 0.999],
    }  # fmt: skip
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
        ("model_name_or_path: m\ndataset_name: d\ngeneration_batch_size: 16\nsteps_per_generation: 2\n", "generation_batch_size = 16 and steps_per_generation = 2: give one of them (TRL refuses both)"),
        ("model_name_or_path: m\ndataset_name: d\ngeneration_batch_size: 12\n", "generation_batch_size = 12 must be a multiple of per_device_train_batch_size × num_processes = 8 × 1"),
        ("model_name_or_path: m\ndataset_name: d\nnum_generations: 1\nper_device_train_batch_size: 4\n", "num_generations = 1: GRPO needs 2 or more samples a prompt"),
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


#: A converted config's sections whose options are not named by a `class_path` beside them.
OWNERS = {
    "model": "composer_lightning.training.module.ComposerModule",
    "rollout.init_args.sampling": "composer_lightning.engines.SamplingConfig",
}


def _class(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _effective(config: dict, path: str):
    """The value a run of `config` uses at the dotted `path`: the config's own, else the default
    of the class that takes it (e.g. `torch.optim.AdamW`'s weight_decay 0.01), tuples as lists."""
    node, owner, where = config, None, []
    for key in path.split("."):
        if isinstance(node, dict) and "class_path" in node:
            owner = node["class_path"]  # the class the `init_args` below it go to
        if isinstance(node, list) or key in node:
            node = node[int(key)] if isinstance(node, list) else node[key]
            where.append(key)
            continue
        cls = _class(owner if where[-1] == "init_args" else OWNERS[".".join(where)])
        if dataclasses.is_dataclass(cls):
            node = {f.name: f for f in dataclasses.fields(cls)}[key].default
        else:
            node = inspect.signature(cls.__init__).parameters[key].default
        break
    return list(node) if isinstance(node, tuple) else node


#: TRL 1.16's default of each field of `GRPOConfig` (and the `TrainingArguments` it inherits) that
#: changes how a run trains, and what a config that leaves it out converts to: (field, TRL's
#: default after `__post_init__`, path in the converted config, the value a run uses there).
#: Differences by design are not rows: dropout is always off here (TRL's `disable_dropout`
#: False), and an unshaped vLLM sampler is checked by the canary, not importance-corrected.
TRAINING_DEFAULTS = [
    ("learning_rate", 1e-6, "model.optimizer.init_args.lr", 1e-6),
    ("weight_decay", 0.0, "model.optimizer.init_args.weight_decay", 0.0),
    ("adam_beta1", 0.9, "model.optimizer.init_args.betas", [0.9, 0.999]),
    ("adam_beta2", 0.999, "model.optimizer.init_args.betas", [0.9, 0.999]),
    ("adam_epsilon", 1e-8, "model.optimizer.init_args.eps", 1e-8),
    ("max_grad_norm", 1.0, "model.max_grad_norm", 1.0),
    ("bf16", True, "trainer.precision", "bf16-mixed"),
    ("gradient_checkpointing", True, "model.activation_checkpointing", True),
    ("activation_checkpointing", True, "model.activation_checkpointing", True),
    ("lr_scheduler_type", "linear", "model.lr_scheduler", {"class_path": "composer_lightning.training.lr_schedule.WarmupDecayLR", "init_args": {"total_steps": 100, "warmup_steps": 0, "decay": "linear"}}),
    ("warmup_steps", 0, "model.lr_scheduler.init_args.warmup_steps", 0),
    ("per_device_train_batch_size", 8, "model.micro_batch_size", 8),
    ("gradient_accumulation_steps", 1, "model.minibatches", 1),
    ("num_generations", 8, "rollout.init_args.group_size", 8),
    ("num_iterations", 1, "model.ppo_epochs", 1),
    ("max_completion_length", 512, "rollout.init_args.sampling.max_tokens", 512),
    ("temperature", 1.0, "rollout.init_args.sampling.temperature", 1.0),
    ("top_p", 1.0, "rollout.init_args.sampling.top_p", 1.0),
    ("top_k", 0, "rollout.init_args.sampling.top_k", None),
    ("min_p", None, "rollout.init_args.sampling.min_p", 0.0),
    ("repetition_penalty", 1.0, "rollout.init_args.sampling.repetition_penalty", 1.0),
    ("beta", 0.0, "model.heads.1", "no KL head"),
    ("epsilon", 0.2, "model.clip_low", 0.2),
    ("epsilon_high", None, "model.clip_high", 0.2),
    ("delta", None, "model.dual_clip", None),
    ("loss_type", "dapo", "model.aggregation", "token_mean"),
    ("scale_rewards", "group", "model.heads.0.init_args.scale_rewards", "group"),
    ("multi_objective_aggregation", "sum_then_normalize", "model.heads.0.init_args.multi_objective_aggregation", "sum_then_normalize"),
    ("importance_sampling_level", "token", "model.importance_sampling_level", "token"),
    ("top_entropy_quantile", 1.0, "model.top_entropy_quantile", 1.0),
    ("entropy_coef", 0.0, "model.entropy_coef", 0.0),
    ("use_adaptive_entropy", False, "model.adaptive_entropy", None),
    ("mask_truncated_completions", False, "rollout.init_args.mask_truncated_completions", False),
    ("sync_ref_model", False, "model.ref_model_sync_steps", 0),
    ("seed", 42, "seed_everything", 42),
]  # fmt: skip

#: The least a TRL config gives (`max_steps`: TRL counts epochs of a sized dataset instead).
MINIMAL = {"model_name_or_path": "m", "dataset_name": "d", "max_steps": 100}


def _convert(fields: dict, processes: int = 1) -> tuple[dict, list[str]]:
    """`convert` of MINIMAL + `fields` for `processes` processes of a GPU machine, wherever the
    test runs."""
    from composer_lightning.from_trl import Host, convert

    host = Host(gpu=True, cpu_bf16=False)
    return convert({**MINIMAL, **fields}, num_processes=processes, host=host)


def _converted(**fields) -> dict:
    return _convert(fields)[0]


@pytest.mark.parametrize(("field", "default", "path", "value"), TRAINING_DEFAULTS)
def test_a_field_left_out_trains_at_trls_default(field, default, path, value):
    """Left out, each field converts to the option that trains as TRL's default does; written
    out at that default, the conversion is the same."""
    config = _converted()
    if value == "no KL head":
        assert [h["class_path"].rpartition(".")[2] for h in config["model"]["heads"]] == [
            "DrGRPOHead"
        ]
    else:
        assert _effective(config, path) == value, path
    if default is not None:
        assert _converted(**{field: default}) == config


def test_the_table_holds_trls_own_defaults(tmp_path):
    """Each row's default is TRL's, read from its dataclass (when `trl` is installed)."""
    pytest.importorskip("trl", reason="trl not installed (pip install -e .[bench])")
    from trl import GRPOConfig

    trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    for field, default, _, _ in TRAINING_DEFAULTS:
        if field == "activation_checkpointing" and not hasattr(trl, field):
            continue  # an older transformers: gradient_checkpointing is its only name
        value = getattr(trl, field)
        assert getattr(value, "value", value) == default, field


@pytest.mark.parametrize(
    ("fields", "init_args", "note"),
    [
        ({"warmup_steps": 10}, {"total_steps": 100, "warmup_steps": 10, "decay": "linear"}, None),
        ({"warmup_steps": 0.25}, {"total_steps": 100, "warmup_steps": 25, "decay": "linear"}, None),
        ({"warmup_ratio": 0.015}, {"total_steps": 100, "warmup_steps": 2, "decay": "linear"}, None),
        ({"warmup_ratio": 0.05, "warmup_steps": 3}, {"total_steps": 100, "warmup_steps": 3, "decay": "linear"}, None),
        ({"lr_scheduler_type": "cosine", "warmup_steps": 2}, {"total_steps": 100, "warmup_steps": 2, "decay": "cosine"}, None),
        ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}, {"total_steps": 100, "warmup_steps": 0, "decay": "cosine", "min_lr_rate": 0.1}, None),
        ({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 5}, {"total_steps": 100, "warmup_steps": 5, "decay": "constant"}, None),
        ({"lr_scheduler_type": "constant", "warmup_steps": 5}, None, None),
        ({"lr_scheduler_type": "polynomial"}, None, "not carried: lr_scheduler_type: polynomial — not yet here"),
        ({"max_steps": None}, None, "not carried: lr_scheduler_type: linear — its decay runs over max_steps, and none is given"),
    ],
)  # fmt: skip
def test_trls_lr_schedule_converts(fields, init_args, note):
    """TRL's (transformers') schedule with its warmup as steps, as a share of the run (below 1)
    or as the older `warmup_ratio`; one it cannot carry is a constant lr and a comment line."""
    from composer_lightning.from_trl import convert

    config, notes = convert({**MINIMAL, **fields})
    sched = config["model"]["lr_scheduler"]
    assert (sched and sched["init_args"]) == init_args
    said = [n for n in notes if "lr_scheduler" in n]
    if note is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(note), said


def test_the_converted_schedule_sets_trls_lr_at_every_step():
    """TRL's default schedule (linear to 0 over max_steps) with a 3-step warmup, built from the
    converted config, sets the lr transformers' Trainer sets at each of the 10 optimizer steps:
    0, 1/3, 2/3 of 1e-6, then (10 − s) / 7 of it."""
    import torch
    from transformers import get_scheduler

    config = _converted(max_steps=10, warmup_steps=3)
    sched = config["model"]["lr_scheduler"]
    lrs = {}
    for who in ("converted", "transformers"):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
        if who == "converted":
            schedule = _class(sched["class_path"])(opt, **sched["init_args"])
        else:
            schedule = get_scheduler("linear", opt, num_warmup_steps=3, num_training_steps=10)
        lrs[who] = []
        for _ in range(10):
            lrs[who].append(opt.param_groups[0]["lr"])
            opt.step()
            schedule.step()
    assert lrs["converted"] == pytest.approx(lrs["transformers"], rel=1e-12, abs=1e-20)
    assert lrs["converted"][:4] == pytest.approx([0.0, 1e-6 / 3, 2e-6 / 3, 1e-6])


CPU_BF16_NOTE = "converted: bf16: true (TRL's default) — trains on CPU (no GPU on this machine) with bf16 units: bf16-mixed"


@pytest.mark.parametrize(
    ("fields", "gpu", "cpu_bf16", "precision", "note"),
    [
        ({}, True, False, "bf16-mixed", None),
        ({}, False, True, "bf16-mixed", CPU_BF16_NOTE),
        ({"use_cpu": True}, True, True, "bf16-mixed", "converted: bf16: true (TRL's default) — trains on CPU (use_cpu: true) with bf16 units"),
        ({}, False, False, "32-true", "converted: bf16: true (TRL's default) — trains on CPU (no GPU on this machine) without bf16 units (AVX512-BF16 or AMX), where bf16 is emulated and several times slower: 32-true"),
        ({"bf16": True}, False, False, "bf16-mixed", "converted: bf16: true — trains on CPU (no GPU on this machine) without bf16 units (AVX512-BF16 or AMX): bf16-mixed as asked"),
        ({"bf16": False}, False, True, "32-true", None),
        ({"fp16": True}, True, False, "32-true", "not carried: fp16: true — converted as 32-true"),
    ],
)  # fmt: skip
def test_trls_bf16_default_converts_by_where_the_run_trains(fields, gpu, cpu_bf16, precision, note):
    """TRL's `bf16` is true unless `fp16`, on CPU too: bf16-mixed on a GPU; on CPU, bf16-mixed
    where the CPU has bf16 units or the config asks for it, else 32-true; on CPU the notes say
    which and why."""
    from composer_lightning.from_trl import Host, convert

    config, notes = convert({**MINIMAL, **fields}, host=Host(gpu=gpu, cpu_bf16=cpu_bf16))
    assert config["trainer"]["precision"] == precision
    said = [n for n in notes if "bf16" in n or "fp16" in n]
    assert said == [] if note is None else len(said) == 1 and said[0].startswith(note), said


def test_this_machines_bf16_units_are_found():
    """`Host.this_machine()` finds bf16 units where Linux lists them (AVX512-BF16, AMX)."""
    from pathlib import Path

    from composer_lightning.from_trl import Host

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = set(cpuinfo.read_text().split())
    host = Host.this_machine()
    assert host.cpu_bf16 == bool(flags & {"avx512_bf16", "amx_tile"})


@pytest.mark.parametrize(
    ("fields", "note"),
    [
        ({"loss_type": "dr_grpo", "entropy_coef": 0.01}, "converted: entropy_coef: 0.01 — the bonus is reduced like the loss of loss_type dr_grpo (model.aggregation: token_sum_norm), Σ H / (rows × max_completion_length)"),
        ({"loss_type": "dr_grpo", "use_adaptive_entropy": True}, "converted: entropy_coef: 0.0 — the bonus is reduced like the loss of loss_type dr_grpo"),
        ({"loss_type": "grpo", "entropy_coef": 0.01}, "converted: entropy_coef: 0.01 — the bonus is reduced like the loss of loss_type grpo (model.aggregation: seq_mean_token_mean)"),
        ({"loss_type": "dapo", "entropy_coef": 0.01}, None),
        ({"loss_type": "dr_grpo"}, None),
    ],
)  # fmt: skip
def test_an_entropy_bonus_reduced_otherwise_than_trls_is_said(fields, note):
    """TRL takes the entropy bonus's token mean whatever the loss_type; here it is reduced like
    the loss (`model.aggregation`), so under dr_grpo or grpo a comment line says so."""
    _, notes = _convert(fields)
    said = [n for n in notes if "entropy" in n]
    assert said == [] if note is None else len(said) == 1 and said[0].startswith(note), said


@pytest.mark.parametrize(
    ("fields", "on"),
    [
        ({}, True),
        ({"gradient_checkpointing": False}, False),
        ({"activation_checkpointing": False}, False),
        ({"activation_checkpointing": True, "gradient_checkpointing": False}, True),
    ],
)
def test_gradient_checkpointing_is_on_unless_turned_off_by_either_name(fields, on):
    """TRL's default is on; transformers 5 names it `activation_checkpointing`, which wins over
    its older alias `gradient_checkpointing`."""
    assert _converted(**fields)["model"]["activation_checkpointing"] is on


#: TRL batch fields, the processes converted for, and what a rollout batch is here per rank:
#: (fields, num_processes, optimizer steps a generation, rows a forward, prompts per rank).
#: TRL: steps_per_generation = generation_batch_size / (per_device_train_batch_size ×
#: num_processes), optimizer steps a generation = steps_per_generation /
#: gradient_accumulation_steps, prompts a generation = generation_batch_size / num_generations
#: over all processes.
BATCH_SHAPES = [
    ({"per_device_train_batch_size": 8, "generation_batch_size": 32}, 1, 4, 8, 4),
    ({"per_device_train_batch_size": 8, "steps_per_generation": 4}, 1, 4, 8, 4),
    ({"per_device_train_batch_size": 8, "generation_batch_size": 32}, 4, 1, 8, 1),
    ({"per_device_train_batch_size": 8, "generation_batch_size": 64}, 2, 4, 8, 4),
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4}, 2, 1, 4, 2),
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4, "generation_batch_size": 32}, 1, 4, 4, 8),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "processes", "updates", "rows", "prompts"), BATCH_SHAPES)
def test_trls_batch_fields_count_as_trl_counts_them(fields, processes, updates, rows, prompts):
    """A generation makes as many optimizer steps as TRL makes (`model.minibatches`), of the
    same completions per rank; TRL's `generation_batch_size` is global, so on N processes each
    rank generates 1/N of it; the trainer runs on those N processes, and a note says so."""
    config, notes = _convert(fields, processes)
    model, data = config["model"], config["data"]["init_args"]
    assert (model["minibatches"], model["micro_batch_size"]) == (updates, rows)
    assert data["prompts_per_step"] == prompts
    assert config["trainer"]["devices"] == processes
    (said,) = [n for n in notes if n.startswith("converted: num_processes")]
    assert said.startswith(f"converted: num_processes: {processes} — converted for {processes}")


def test_the_batch_rows_are_trls_own_counts(tmp_path, monkeypatch):
    """Each row's counts are those TRL's own `GRPOConfig` derives (when `trl` is installed), its
    `world_size` standing in for the processes."""
    pytest.importorskip("trl", reason="trl not installed (pip install -e .[bench])")
    from trl import GRPOConfig

    for fields, processes, updates, rows, prompts in BATCH_SHAPES:
        monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self, n=processes: n))
        trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **fields)
        steps = trl.steps_per_generation // trl.gradient_accumulation_steps
        per_rank = trl.generation_batch_size // (trl.num_generations * processes)
        assert (steps, trl.per_device_train_batch_size, per_rank) == (updates, rows, prompts)


def test_the_command_line_converts_for_n_processes(tmp_path):
    """`--num-processes 4`: TRL's generation_batch_size of 32 is 8 completions (1 prompt) a
    rank, on 4 devices."""
    import yaml

    from tests.helpers import run_cli

    trl = tmp_path / "grpo.yaml"
    trl.write_text(
        "model_name_or_path: m\ndataset_name: d\ngeneration_batch_size: 32\nbf16: false\n"
    )
    out = run_cli("from-trl", str(trl), "--num-processes", "4")
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["data"]["init_args"]["prompts_per_step"] == 1
    assert config["trainer"]["devices"] == 4
    assert "# converted: num_processes: 4 — converted for 4 process(es)" in out.stdout
    bad = run_cli("from-trl", str(trl), "--num-processes", "0")
    assert bad.returncode == 2 and "num_processes must be an integer >= 1, got 0" in bad.stderr


def test_a_shape_whose_groups_would_span_ranks_is_refused():
    """TRL spreads a group over processes; here a group's samples stay on one rank, so 16
    completions of groups of 8 on 4 processes (4 a rank) cannot convert."""
    from composer_lightning.from_trl import convert

    fields = {"per_device_train_batch_size": 4, "generation_batch_size": 16}
    with pytest.raises(ValueError) as info:
        convert({**MINIMAL, **fields}, num_processes=4)
    assert str(info.value) == (
        "per_device_train_batch_size × steps_per_generation = 4 × 1 = 4 completions per rank "
        "and generation must be whole groups of num_generations = 8 (a group's samples stay on "
        "one rank here)"
    )


#: TRL batch shapes whose optimizer step takes part of a group (TRL trains them): (fields, the
#: error's words).
SPLIT_GROUPS = [
    ({"per_device_train_batch_size": 4, "steps_per_generation": 4}, "per_device_train_batch_size × gradient_accumulation_steps = 4 × 1 = 4 completions per optimizer step and rank would split a group of num_generations = 8: here each optimizer step takes whole groups (model.minibatches split along groups); give a multiple of 8"),
    ({"per_device_train_batch_size": 6, "num_generations": 4, "steps_per_generation": 2}, "= 6 × 1 = 6 completions per optimizer step and rank would split a group of num_generations = 4"),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "generation_batch_size": 16}, "= 2 × 2 = 4 completions per optimizer step and rank would split a group of num_generations = 8"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), SPLIT_GROUPS)
def test_a_minibatch_that_would_split_a_group_fails_at_conversion(fields, message):
    """A group's samples train in one optimizer step here (their advantages are one group's),
    so a TRL optimizer step of part of a group is refused when converting, naming the values,
    not at step 1 of the run (`RolloutBatch.group_splits`) or, worse, as uneven minibatches."""
    from composer_lightning.from_trl import convert

    with pytest.raises(ValueError) as info:
        convert({**MINIMAL, **fields})
    assert message in str(info.value)


@pytest.mark.parametrize(("fields", "processes", "updates", "rows", "prompts"), BATCH_SHAPES)
def test_a_converted_rollout_batch_splits_into_trls_optimizer_steps(
    fields, processes, updates, rows, prompts
):
    """What a converted shape is for: a rank's rollout batch (prompts × G rows, groups
    contiguous) splits along groups into `model.minibatches` optimizer steps of exactly TRL's
    per_device_train_batch_size × gradient_accumulation_steps completions each."""
    import torch

    from composer_lightning.protocols.batch import RolloutBatch

    config, _ = _convert(fields, processes)
    G = config["rollout"]["init_args"]["group_size"]
    B = config["data"]["init_args"]["prompts_per_step"] * G
    ids = torch.ones(B, 2, dtype=torch.long)
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.tensor([[False, True]] * B),
        rewards=torch.zeros(B),
        has_reward=torch.ones(B, dtype=torch.bool),
        group_ids=torch.arange(B) // G,
        max_response_length=1,
    )
    splits = batch.group_splits(config["model"]["minibatches"])
    accumulation = fields.get("gradient_accumulation_steps", 1)
    assert [len(s) for s in splits] == [rows * accumulation] * updates


@pytest.mark.parametrize("key", ["max_steps", "eval_steps", "save_steps"])
def test_a_step_count_inside_a_generation_fails_at_conversion(key):
    """TRL stops, evaluates and saves at any optimizer step; here only between rollout batches
    (2 optimizer steps each with num_iterations 2), so 3 is refused when converting, naming the
    next count that works, not at the run's setup."""
    from composer_lightning.from_trl import convert

    with pytest.raises(ValueError) as info:
        convert({**MINIMAL, "num_iterations": 2, key: 3})
    assert str(info.value) == (
        f"{key} = 3 counts optimizer steps, and a generation makes num_iterations × "
        "steps_per_generation / gradient_accumulation_steps = 2 of them here, where a run stops,"
        " evaluates and saves only between generations: give a multiple of 2 (e.g. 4)"
    )

"""`python -m composer_lightning from-trl grpo.yaml > run.yaml`: a TRL GRPO config as this
library's `fit` config.

The input is the YAML `trl grpo --config` takes: `GRPOConfig`'s fields, the `TrainingArguments`
ones it inherits, and the script's (`model_name_or_path`, `dataset_name`, `reward_funcs`,
LoRA's `use_peft` / `lora_*`). Each field it carries becomes the option that does the same
(the table in `docs/from_trl.md`); a field TRL leaves at its default is converted at TRL's
default, so the run keeps TRL's behaviour (`loss_type: dapo`, `scale_rewards: group`,
`epsilon_high` = `epsilon`, 8 generations, lr 1e-6 decaying linearly to 0, weight decay 0, bf16,
gradient checkpointing) where this library's or torch's defaults differ. Each field it cannot
carry is one comment line at the top of the output saying why (`# not carried: ...`), and so is
each choice a TRL user would not expect (`# converted: ...`).

Batch shape (`_batch_shape`): TRL generates `generation_batch_size` completions over all
processes a generation (`per_device_train_batch_size × num_processes × steps_per_generation`)
and makes one optimizer step per `gradient_accumulation_steps` micro-batches; here a rollout
batch is `data.prompts_per_step × rollout.group_size` completions per rank, trained in
`model.minibatches` optimizer steps of micro-batches of `model.micro_batch_size` rows, repeated
`model.ppo_epochs` (TRL's `num_iterations`) times, on `trainer.devices` = the `num_processes`
converted for.

Why this file is long: it is the table of docs/from_trl.md as code, one place for each of the
≈ 90 fields a TRL config can hold, so that a field's conversion is found beside its neighbours,
with the rules TRL applies to them (its batch counting, lr schedules, bf16 default) written
where they are read; each is a small function.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

#: TRL 1.16's defaults (`GRPOConfig` and the `TrainingArguments` it inherits) of the fields read
#: through `_Fields.take`: a field not given converts at this value, never at this library's
#: default or torch's (`torch.optim.AdamW`'s weight_decay is 0.01, TRL's 0.0).
TRL_DEFAULTS: dict[str, Any] = {
    "num_generations": 8,
    "max_completion_length": 512,
    "learning_rate": 1e-6,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "epsilon": 0.2,
    "temperature": 1.0,
    "beta": 0.0,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "seed": 42,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "warmup_ratio": 0.0,  # transformers 4's; transformers 5 reads a warmup_steps below 1 so
    "max_steps": -1,
    "gradient_checkpointing": True,
    "entropy_coef": 0.0,
}

#: transformers 5's names of fields and the older aliases read where the new name is not given.
ALIASES = {"activation_checkpointing": "gradient_checkpointing"}

#: How `model.aggregation` reduces the entropy bonus where it is not TRL's token mean (TRL takes
#: the token mean whatever the `loss_type`; here the bonus is reduced like the loss).
ENTROPY_REDUCTION = {
    "token_sum_norm": "Σ H / (rows × max_completion_length): mean length / max_completion_length "
    "of TRL's token mean",
    "seq_mean_token_mean": "the mean of each response's token mean, where TRL's token mean weighs "
    "long responses more",
}

#: transformers' `lr_scheduler_type` → `WarmupDecayLR.decay`, for the schedules it has here.
LR_DECAY = {
    "linear": "linear",
    "cosine": "cosine",
    "cosine_with_min_lr": "cosine",
    "constant_with_warmup": "constant",
}

#: TRL's `loss_type` → `model.aggregation`.
AGGREGATION = {
    "dr_grpo": "token_sum_norm",
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "sapo": "seq_mean_token_mean",
}

#: Every `loss_type` TRL 1.16 accepts.
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

#: Fields with nothing to carry them here, and why (one comment line each).
NOT_CARRIED = {
    "num_train_epochs": "steps count rollout batches here: give max_steps",
    "vllm_mode": "colocate only: one in-process engine per rank (server mode: not yet)",
    "vllm_server_base_url": "server mode is not yet a training engine",
    "trust_remote_code": "not yet",
    "ds3_gather_for_generation": "no DeepSpeed here (FSDP2 gathers for the push)",
}

#: Fields that say nothing a run here needs (bookkeeping of TRL's own trainer).
IGNORED = {
    "report_to", "push_to_hub", "hub_model_id", "logging_dir", "remove_unused_columns",
    "overwrite_output_dir", "do_train", "do_eval", "run_name", "disable_dropout",
    "shuffle_dataset", "save_strategy", "eval_strategy", "logging_strategy", "use_cpu",
    "model_revision",
}  # fmt: skip

#: TRL's `loss_type` → `model.loss_mode` where it is not the clipped surrogate.
LOSS_MODE = {"cispo": "cispo", "sapo": "sapo"}


def _get(trl: dict[str, Any], key: str) -> Any:
    if trl.get(key) is None and key in ALIASES:
        return _get(trl, ALIASES[key])
    return trl[key] if trl.get(key) is not None else TRL_DEFAULTS.get(key)


class _Fields:
    """The TRL config being converted: `take` reads a field (TRL's default where it is not
    given) and marks it carried; `notes` are the output's comment lines."""

    def __init__(self, trl: dict[str, Any]):
        self.trl = trl
        self.used: set[str] = set()
        self.notes: list[str] = []

    def take(self, key: str) -> Any:
        self.used.add(key)
        return _get(self.trl, key)

    def skip(self, note: str) -> None:
        """A comment line: a field not carried, and why."""
        self.notes.append(f"not carried: {note}")

    def say(self, note: str) -> None:
        """A comment line: a choice the conversion made that a TRL user would not expect."""
        self.notes.append(f"converted: {note}")


def convert(
    trl: dict[str, Any], *, num_processes: int = 1, host: Host | None = None
) -> tuple[dict[str, Any], list[str]]:
    """This library's `fit` config of the TRL GRPO config `trl`, and its comment lines: each
    field it does not carry (`not carried: ...`) and each choice a TRL user would not expect
    (`converted: ...`).

    Args:
        trl: the YAML `trl grpo --config` takes, as a dict.
        num_processes: the processes the run trains on (TRL's world size): TRL's
            `generation_batch_size` counts all of them, this library's options are per rank.
        host: where the run will train (bf16 on CPU depends on it); None: this machine.

    Raises:
        ValueError: no `model_name_or_path`, no `dataset_name`, a batch shape TRL refuses, one
            that would split a group across ranks or optimizer steps, or a step count between
            two of a generation's optimizer steps (naming the fields and values).
    """
    if not isinstance(trl, dict) or not trl.get("model_name_or_path"):
        raise ValueError("a TRL GRPO config needs model_name_or_path")
    if not trl.get("dataset_name"):
        raise ValueError("a TRL GRPO config needs dataset_name (a hub id or a local file)")
    fields = _Fields(trl)
    shape = _batch_shape(fields, num_processes)
    seed = int(fields.take("seed"))
    max_steps = int(fields.take("max_steps"))
    sampling = _sampling(fields, seed)
    model = _model(fields, shape, max_steps, int(sampling["max_tokens"]))
    rollout = _rollout(fields, shape, seed, sampling)
    data = _data(fields, shape, seed)
    _check_step_counts(trl, model["ppo_epochs"] * shape.minibatches)
    trainer = _trainer(fields, max_steps, host, num_processes)
    for key, value in trl.items():
        if key in fields.used or key in IGNORED:
            continue
        why = NOT_CARRIED.get(key, "not carried by this converter (docs/from_trl.md)")
        fields.skip(f"{key}: {value!r} — {why}")
    config = {
        "seed_everything": seed,
        "trainer": trainer,
        "model": model,
        "rollout": {"class_path": "composer_lightning.rollout.callback.RolloutCallback",
                    "init_args": rollout},
        "data": data,
    }  # fmt: skip
    return config, fields.notes


def _sampling(fields: _Fields, seed: int) -> dict[str, Any]:
    """`rollout.sampling`: temperature, length, seed, and the sampler's shaping TRL was given."""
    trl, used = fields.trl, fields.used
    sampling: dict[str, Any] = {
        "temperature": float(fields.take("temperature")),
        "max_tokens": int(fields.take("max_completion_length")),
        "seed": seed,
    }
    for key, default in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
        used.add(key)
        if trl.get(key) not in (None, default):
            sampling[key] = trl[key]
    used.add("generation_kwargs")
    if trl.get("generation_kwargs"):
        sampling["generation_kwargs"] = dict(trl["generation_kwargs"])
    return sampling


def _model(fields: _Fields, shape: BatchShape, max_steps: int, max_tokens: int) -> dict[str, Any]:
    """The `model:` section: the policy and its loading, the heads, the surrogate, the batch
    split, the optimizer and its schedule, LoRA."""
    trl, used, take = fields.trl, fields.used, fields.take
    policy = str(take("model_name_or_path"))
    if trl.get("model_revision"):
        policy = f"{policy}@{trl['model_revision']}"
    loss_type = str(take("loss_type"))
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not TRL's; expected one of {TRL_LOSS_TYPES}")
    aggregation = AGGREGATION.get(loss_type)
    if aggregation is None:
        fields.skip(f"loss_type: {loss_type} — not yet here; converted as dapo (token_mean)")
        aggregation = "token_mean"
    epsilon = float(take("epsilon"))
    model: dict[str, Any] = {
        "policy": policy,
        "heads": _heads(fields),
        "optimizer": _optimizer(fields),
        "lr_scheduler": _lr_scheduler(fields, max_steps),
        "aggregation": aggregation,
        "clip_low": epsilon,
        "clip_high": float(trl.get("epsilon_high") or epsilon),
        "ppo_epochs": int(trl.get("num_iterations") or 1),
        "minibatches": shape.minibatches,
        "micro_batch_size": shape.micro_batch_size,
        "max_grad_norm": take("max_grad_norm"),
        "entropy_coef": float(take("entropy_coef")),
        "activation_checkpointing": bool(take("activation_checkpointing")),
    }
    used.update({"epsilon_high", "num_iterations", "gradient_checkpointing"})
    if model["entropy_coef"] or trl.get("use_adaptive_entropy"):
        _entropy_note(fields, model["entropy_coef"], aggregation, loss_type)
    model.update(_surrogate(trl, used, fields.skip, loss_type, model["clip_high"]))
    init_kwargs = dict(trl.get("model_init_kwargs") or {})
    for key, name in (("dtype", "dtype"), ("torch_dtype", "dtype"), ("attn_implementation",) * 2):
        if trl.get(key) not in (None, "auto"):
            init_kwargs.setdefault(name, trl[key])
    used.update({"model_init_kwargs", "dtype", "torch_dtype", "attn_implementation"})
    if init_kwargs:
        model["model_init_kwargs"] = init_kwargs
    if loss_type == "dr_grpo":
        model["norm_length"] = max_tokens  # TRL divides by max_completion_length
    if trl.get("use_peft"):
        model["peft"] = {
            "class_path": "peft.LoraConfig",
            "init_args": {
                "r": int(trl.get("lora_r", 16)),
                "lora_alpha": int(trl.get("lora_alpha", 32)),
                "lora_dropout": float(trl.get("lora_dropout", 0.05)),
                "target_modules": trl.get("lora_target_modules") or "all-linear",
            },
        }
    used.update({"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"})
    return model


def _heads(fields: _Fields) -> list[dict[str, Any]]:
    """Dr. GRPO at TRL's reward scaling and multi-objective aggregation; with `beta` > 0, TRL's
    k3 KL penalty in the loss."""
    fields.used.add("multi_objective_aggregation")
    objectives = str(fields.trl.get("multi_objective_aggregation") or "sum_then_normalize")
    scale = fields.take("scale_rewards")
    scale = {True: "group", False: "none"}.get(scale, scale)
    heads: list[dict[str, Any]] = [
        {
            "class_path": "composer_lightning.heads.dr_grpo.DrGRPOHead",
            "init_args": {
                "weight": 1.0,
                "scale_rewards": str(scale),
                "multi_objective_aggregation": objectives,
            },
        }
    ]
    beta = float(fields.take("beta"))
    if beta > 0:
        heads.append(
            {
                "class_path": "composer_lightning.heads.kl.KLHead",
                "init_args": {"kl_coef": beta, "estimator": "k3", "placement": "loss"},
            }
        )
    return heads


def _rollout(
    fields: _Fields, shape: BatchShape, seed: int, sampling: dict[str, Any]
) -> dict[str, Any]:
    """The `rollout:` section's arguments: the engine, the group, the reward functions, tool
    turns and the logged completions."""
    trl, used = fields.trl, fields.used
    funcs = trl.get("reward_funcs") or []
    used.update({"reward_funcs", "reward_weights"})
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    funcs = [f if "." in f else f"trl.rewards.{f}" for f in funcs]  # TRL's built-in names
    rollout: dict[str, Any] = {
        "engine": _engine(fields, seed),
        "group_size": shape.group_size,
        "sampling": sampling,
        "mask_truncated_completions": bool(trl.get("mask_truncated_completions", False)),
        "val_samples": int(trl.get("num_generations_eval") or shape.group_size),
    }
    used.update({"mask_truncated_completions", "num_generations_eval"})
    if funcs:
        score: dict[str, Any] = {"fn": funcs}
        if trl.get("reward_weights"):
            score["reward_weights"] = [float(w) for w in trl["reward_weights"]]
        rollout["score"] = {
            "class_path": "composer_lightning.tasks.FunctionScore",
            "init_args": score,
        }
    else:
        fields.skip("reward_funcs: none given — the data's task verifier scores (data.task)")
    if trl.get("max_tool_calling_iterations"):
        rollout["max_turns"] = int(trl["max_tool_calling_iterations"]) + 1
    used.add("max_tool_calling_iterations")
    if trl.get("log_completions"):
        rollout["samples_every_n_steps"] = int(trl.get("logging_steps") or 10)
        rollout["samples_per_step"] = int(trl.get("num_completions_to_print") or 4)
    else:
        rollout["samples_every_n_steps"] = 0
    used.update({"log_completions", "num_completions_to_print"})
    return rollout


def _engine(fields: _Fields, seed: int) -> dict[str, Any]:
    """vLLM with TRL's `use_vllm` (its memory, context, sleep mode and tensor parallelism),
    else transformers' `generate`."""
    trl, used = fields.trl, fields.used
    used.add("use_vllm")
    engine: dict[str, Any] = {
        "class_path": "composer_lightning.engines."
        + ("VLLMEngine" if trl.get("use_vllm") else "HFEngine"),
        "init_args": {"seed": seed},
    }
    if trl.get("use_vllm"):
        args = engine["init_args"]
        for key, name in (
            ("vllm_gpu_memory_utilization", "gpu_memory_utilization"),
            ("vllm_max_model_length", "max_model_len"),
            ("vllm_enable_sleep_mode", "enable_sleep_mode"),
        ):
            used.add(key)
            if trl.get(key) is not None:
                args[name] = trl[key]
        used.add("vllm_tensor_parallel_size")
        if int(trl.get("vllm_tensor_parallel_size") or 1) > 1:
            args["llm_kwargs"] = {"tensor_parallel_size": int(trl["vllm_tensor_parallel_size"])}
    return engine


def _data(fields: _Fields, shape: BatchShape, seed: int) -> dict[str, Any]:
    """The `data:` section: the dataset's prompts, `prompts_per_step` of them a rollout batch."""
    trl, used = fields.trl, fields.used
    data: dict[str, Any] = {
        "class_path": "composer_lightning.datamodules.rollout.RolloutDataModule",
        "init_args": {
            "task": None,
            "dataset": str(trl["dataset_name"]),
            "dataset_config": trl.get("dataset_config"),
            "split": str(trl.get("dataset_train_split") or "train"),
            "prompts_per_step": shape.prompts_per_step,
            "seed": seed,
        },
    }
    used.update({"dataset_name", "dataset_config", "dataset_train_split"})
    if trl.get("max_prompt_length"):
        data["init_args"]["max_prompt_length"] = int(trl["max_prompt_length"])
    used.add("max_prompt_length")
    if trl.get("chat_template_kwargs"):
        data["init_args"]["chat_template_kwargs"] = dict(trl["chat_template_kwargs"])
    used.add("chat_template_kwargs")
    return data


def _optimizer(fields: _Fields) -> dict[str, Any]:
    """`model.optimizer`: AdamW (TRL's `adamw_torch_fused` is the same update) with every
    argument written, so none falls back to torch's default where TRL's differs."""
    betas = [float(fields.take("adam_beta1")), float(fields.take("adam_beta2"))]
    return {
        "class_path": "torch.optim.AdamW",
        "init_args": {
            "lr": float(fields.take("learning_rate")),
            "weight_decay": float(fields.take("weight_decay")),
            "eps": float(fields.take("adam_epsilon")),
            "betas": betas,
        },
    }


def _entropy_note(fields: _Fields, coef: float, aggregation: str, loss_type: str) -> None:
    """Say where the entropy bonus is reduced otherwise than TRL's token mean."""
    if aggregation in ENTROPY_REDUCTION:
        fields.say(
            f"entropy_coef: {coef} — the bonus is reduced like the loss of loss_type {loss_type} "
            f"(model.aggregation: {aggregation}), {ENTROPY_REDUCTION[aggregation]}: the same "
            "coefficient pulls differently (exactly alike under dapo, bnpo, cispo)"
        )


@dataclass(frozen=True)
class BatchShape:
    """TRL's batch fields as this library's options, per rank.

    Attributes:
        group_size: samples per prompt (`num_generations`).
        micro_batch_size: rows per forward (`per_device_train_batch_size`).
        minibatches: optimizer steps per rollout batch and pass (`steps_per_generation /
            gradient_accumulation_steps`).
        prompts_per_step: prompts per rollout batch and rank (`generation_batch_size /
            (num_processes × num_generations)`).
    """

    group_size: int
    micro_batch_size: int
    minibatches: int
    prompts_per_step: int


def _batch_shape(fields: _Fields, num_processes: int) -> BatchShape:
    """The per-rank batch shape of TRL's batch fields on `num_processes` processes.

    TRL 1.16 (`GRPOConfig.__post_init__`): a generation is `generation_batch_size` completions
    over all processes, `per_device_train_batch_size × num_processes × steps_per_generation`;
    of the two, either one is given or `steps_per_generation` is `gradient_accumulation_steps`;
    an optimizer step takes `gradient_accumulation_steps` micro-batches of each process.

    Raises:
        ValueError: a shape TRL refuses, or one whose groups would span ranks here (naming the
            fields and values).
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an integer >= 1, got {num_processes!r}")
    G = int(fields.take("num_generations"))
    micro = int(fields.take("per_device_train_batch_size"))
    accumulation = int(fields.take("gradient_accumulation_steps"))
    steps = _steps_per_generation(fields, micro, num_processes, accumulation)
    per_rank = micro * steps
    if G < 2:
        raise ValueError(f"num_generations = {G}: GRPO needs 2 or more samples a prompt (as TRL)")
    if per_rank % G:
        raise ValueError(
            f"per_device_train_batch_size × steps_per_generation = {micro} × {steps} = {per_rank}"
            f" completions per rank and generation must be whole groups of num_generations = {G}"
            " (a group's samples stay on one rank here)"
        )
    if steps % accumulation:
        raise ValueError(
            f"steps_per_generation = {steps} must be a multiple of gradient_accumulation_steps = "
            f"{accumulation} (an optimizer step here never spans two generations)"
        )
    if (micro * accumulation) % G:  # else step 1 stops on it (`RolloutBatch.group_splits`)
        raise ValueError(
            f"per_device_train_batch_size × gradient_accumulation_steps = {micro} × {accumulation}"
            f" = {micro * accumulation} completions per optimizer step and rank would split a "
            f"group of num_generations = {G}: here each optimizer step takes whole groups "
            f"(model.minibatches split along groups); give a multiple of {G}"
        )
    fields.say(
        f"num_processes: {num_processes} — converted for {num_processes} process(es) "
        f"(trainer.devices: {num_processes}), each generating {per_rank // G} prompt(s) × {G} "
        f"samples, TRL's generation_batch_size = {per_rank * num_processes} over all of them; "
        "convert with --num-processes N for another count"
    )
    return BatchShape(G, micro, steps // accumulation, per_rank // G)


def _check_step_counts(trl: dict[str, Any], updates: int) -> None:
    """Refuse a step count the converted run would refuse at setup (`callbacks/steps.py`):
    a rollout batch here makes `updates` optimizer steps, and a run stops, evaluates and saves
    only between them; TRL stops anywhere.

    Raises:
        ValueError: `max_steps`, `eval_steps` or `save_steps` not a multiple of `updates`.
    """
    for key in ("max_steps", "eval_steps", "save_steps"):
        value = int(trl.get(key) or 0)
        if value > 0 and value % updates:
            raise ValueError(
                f"{key} = {value} counts optimizer steps, and a generation makes num_iterations ×"
                f" steps_per_generation / gradient_accumulation_steps = {updates} of them here, "
                "where a run stops, evaluates and saves only between generations: give a "
                f"multiple of {updates} (e.g. {math.ceil(value / updates) * updates})"
            )


def _steps_per_generation(
    fields: _Fields, micro: int, num_processes: int, accumulation: int
) -> int:
    """TRL's `steps_per_generation`: given, of the global `generation_batch_size`, or
    `gradient_accumulation_steps`."""
    steps, total = fields.take("steps_per_generation"), fields.take("generation_batch_size")
    if steps is not None and total is not None:
        raise ValueError(
            f"generation_batch_size = {total} and steps_per_generation = {steps}: give one of "
            "them (TRL refuses both)"
        )
    if total is None:
        return int(accumulation if steps is None else steps)
    if int(total) % (micro * num_processes):
        raise ValueError(
            f"generation_batch_size = {total} must be a multiple of per_device_train_batch_size × "
            f"num_processes = {micro} × {num_processes} (as TRL requires)"
        )
    return int(total) // (micro * num_processes)


@dataclass(frozen=True)
class Host:
    """Where a converted run trains, as far as its precision goes.

    Attributes:
        gpu: Lightning's `accelerator: auto` finds a GPU.
        cpu_bf16: the CPU has bf16 units (AVX512-BF16 or AMX); without them bf16 autocast is
            emulated, several times slower than fp32 (7.8× measured on an AVX2 CPU).
    """

    gpu: bool
    cpu_bf16: bool

    @classmethod
    def this_machine(cls) -> Host:
        """The machine converting, taken as the one that will train (the notes say so)."""
        import torch  # here, not at the top: only a bf16 decision needs it

        from composer_lightning.runtime.cpu_precision import cpu_bf16_units

        return cls(gpu=torch.cuda.is_available(), cpu_bf16=cpu_bf16_units() is not None)


def _trainer(
    fields: _Fields, max_steps: int, host: Host | None, num_processes: int
) -> dict[str, Any]:
    """`trainer:` of TRL's step counts, precision, output directory, saves and evaluations, on
    the `num_processes` the batch shape is per rank of."""
    trl = fields.trl
    trainer: dict[str, Any] = {
        "accelerator": "cpu" if trl.get("use_cpu") else "auto",
        "devices": num_processes,
        "max_steps": max_steps,
        "log_every_n_steps": int(trl.get("logging_steps") or 10),
        "precision": _precision(fields, host),
    }
    fields.used.update({"logging_steps", "output_dir", "save_steps", "eval_steps"})
    if max_steps < 0:
        fields.skip("max_steps: none given — the prompt stream has no end; give trainer.max_steps")
    if trl.get("output_dir"):
        trainer["default_root_dir"] = str(trl["output_dir"])
    if trl.get("save_steps"):
        trainer["callbacks"] = [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"every_n_train_steps": int(trl["save_steps"]), "save_last": True},
            }
        ]
    if trl.get("eval_steps"):
        trainer["val_check_interval"] = int(trl["eval_steps"])
    else:
        trainer["limit_val_batches"] = 0
    return trainer


def _precision(fields: _Fields, host: Host | None) -> str:
    """`trainer.precision` of TRL's `bf16` (true unless `fp16`, even on CPU) and `fp16`; on CPU
    bf16 stays where the CPU has bf16 units or the config asks for it, and the notes say which.
    """
    asked = fields.take("bf16")
    if fields.take("fp16"):
        fields.skip(
            "fp16: true — converted as 32-true; give trainer.precision: 16-mixed to keep it"
        )
        return "32-true"
    if asked is False:
        return "32-true"
    host = host or Host.this_machine()
    if host.gpu and not fields.trl.get("use_cpu"):
        return "bf16-mixed"
    bf16 = "bf16: true" if asked else "bf16: true (TRL's default)"
    where = "use_cpu: true" if fields.trl.get("use_cpu") else "no GPU on this machine"
    if host.cpu_bf16:
        fields.say(f"{bf16} — trains on CPU ({where}) with bf16 units: bf16-mixed")
        return "bf16-mixed"
    if asked:
        fields.say(
            f"{bf16} — trains on CPU ({where}) without bf16 units (AVX512-BF16 or AMX): "
            "bf16-mixed as asked, though emulated there it runs several times slower than 32-true"
        )
        return "bf16-mixed"
    fields.say(
        f"{bf16} — trains on CPU ({where}) without bf16 units (AVX512-BF16 or AMX), where bf16 "
        "is emulated and several times slower: 32-true; give bf16: true to keep TRL's bf16-mixed"
    )
    return "32-true"


def _lr_scheduler(fields: _Fields, max_steps: int) -> dict[str, Any] | None:
    """`model.lr_scheduler` of TRL's `lr_scheduler_type`, `warmup_steps` (a share of the run below
    1, as transformers reads it), `warmup_ratio` (transformers before 5) and `lr_scheduler_kwargs`;
    None is a constant lr. Decay runs over `max_steps`, optimizer steps in both libraries.

    Raises:
        ValueError: warmup longer than `max_steps`.
    """
    kind = str(fields.take("lr_scheduler_type")).removeprefix("SchedulerType.").lower()
    steps, ratio = float(fields.take("warmup_steps")), float(fields.take("warmup_ratio"))
    options = dict(fields.take("lr_scheduler_kwargs") or {})
    if kind == "constant":  # transformers' constant schedule has no warmup either
        return None
    if kind not in LR_DECAY:
        fields.skip(
            f"lr_scheduler_type: {kind} — not yet here (linear, cosine, "
            "cosine_with_min_lr, constant_with_warmup, constant are): a constant lr; give "
            "model.lr_scheduler"
        )
        return None
    if max_steps < 1:
        fields.skip(
            f"lr_scheduler_type: {kind} — its decay runs over max_steps, and none is"
            " given: a constant lr; give max_steps (or model.lr_scheduler)"
        )
        return None
    # transformers: whole steps from 1 up, a share of the run below 1, else warmup_ratio's share
    share = steps if 0 < steps < 1 else ratio
    warmup = int(steps) if steps >= 1 else math.ceil(max_steps * share)
    if warmup > max_steps:
        raise ValueError(f"warmup_steps = {warmup} is longer than the run, max_steps = {max_steps}")
    init_args: dict[str, Any] = {"total_steps": max_steps, "warmup_steps": warmup}
    init_args["decay"] = LR_DECAY[kind]
    if kind == "cosine_with_min_lr":
        lr = float(fields.take("learning_rate"))
        init_args["min_lr_rate"] = float(options.pop("min_lr_rate", options.pop("min_lr", 0) / lr))
    if options:
        fields.skip(f"lr_scheduler_kwargs: {options!r} — not yet here")
    return {"class_path": "composer_lightning.training.lr_schedule.WarmupDecayLR",
            "init_args": init_args}  # fmt: skip


def _surrogate(
    trl: dict[str, Any],
    used: set[str],
    skip: Callable[[str], None],
    loss_type: str,
    clip_high: float,
) -> dict[str, Any]:
    """The `model:` options of TRL's surrogate fields: CISPO and SAPO, GSPO's sequence ratio,
    `delta`, the token masks and the synced reference."""
    out: dict[str, Any] = {}
    used.update(
        {
            "importance_sampling_level", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
            "top_entropy_quantile", "off_policy_mask_threshold", "sync_ref_model",
            "ref_model_mixup_alpha", "ref_model_sync_steps",
        }
    )  # fmt: skip
    if loss_type in LOSS_MODE:
        out["loss_mode"] = LOSS_MODE[loss_type]
    if loss_type == "cispo":  # TRL's epsilon_high is CISPO's cap on the weight itself
        cap = float(trl.get("epsilon_high") or trl.get("epsilon") or TRL_DEFAULTS["epsilon"])
        if cap <= 1:
            raise ValueError(
                f"loss_type cispo caps each token's weight at epsilon_high = {cap}, at or below "
                "1 (TRL's default is epsilon); give epsilon_high > 1 (ScaleRL: 5.0)"
            )
        out["clip_high"] = cap - 1
    if loss_type == "sapo":
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if trl.get(key) is not None:
                out[key] = float(trl[key])
    level = trl.get("importance_sampling_level") or "token"
    if level not in ("token", "sequence"):
        raise ValueError(
            f"importance_sampling_level {level!r} is not TRL's; expected 'token' or 'sequence'"
        )
    if level != "token":
        out["importance_sampling_level"] = level
    if trl.get("delta") is not None:
        delta = float(trl["delta"])
        if delta > 1 + clip_high and loss_type not in LOSS_MODE:
            out["dual_clip"] = delta  # the same loss and gradient (functional.policy_loss)
        else:
            skip(
                f"delta: {delta} — carried as model.dual_clip only above 1 + epsilon_high = "
                f"{1 + clip_high} with a clipped loss_type, where the two are the same"
            )
    if trl.get("top_entropy_quantile") not in (None, 1.0):
        out["top_entropy_quantile"] = float(trl["top_entropy_quantile"])
    if trl.get("off_policy_mask_threshold") is not None:
        out["off_policy_mask_threshold"] = float(trl["off_policy_mask_threshold"])
    used.update(
        {"use_adaptive_entropy", "entropy_target", "entropy_coef_delta", "entropy_coef_min",
         "entropy_coef_max"}
    )  # fmt: skip
    if trl.get("use_adaptive_entropy"):
        settings = {}
        for key, name in (
            ("entropy_target", "target"),
            ("entropy_coef_delta", "delta"),
            ("entropy_coef_min", "coef_min"),
            ("entropy_coef_max", "coef_max"),
        ):
            if trl.get(key) is not None:
                settings[name] = float(trl[key])
        out["adaptive_entropy"] = settings
    if trl.get("sync_ref_model"):
        if not float(trl.get("beta") or 0.0):
            raise ValueError(
                "sync_ref_model: true with beta = 0 has no reference to sync (TRL refuses it "
                "too): give beta > 0 or drop sync_ref_model"
            )
        out["ref_model_sync_steps"] = int(trl.get("ref_model_sync_steps") or 512)
        out["ref_model_mixup_alpha"] = float(trl.get("ref_model_mixup_alpha") or 0.6)
    return out


def main(argv: list[str]) -> int:
    """`from-trl <grpo.yaml> [--num-processes N]`: the converted config on stdout, its notes as
    comments."""
    parser = argparse.ArgumentParser(
        prog="python -m composer_lightning from-trl",
        description="A TRL GRPO config (the YAML `trl grpo --config` takes) as a fit config.",
        epilog="e.g. from-trl grpo.yaml --num-processes 8 > run.yaml",
    )
    parser.add_argument("path", metavar="grpo.yaml", help="the TRL GRPO config")
    parser.add_argument(
        "--num-processes",
        type=int,
        metavar="N",
        default=1,
        help="processes (GPUs) the run trains on, TRL's world size (default 1): TRL's "
        "generation_batch_size counts all of them, the converted batch options are per rank",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    path = args.path
    try:
        with open(path, encoding="utf-8") as f:
            trl = yaml.safe_load(f)
        config, notes = convert(trl or {}, num_processes=args.num_processes)
    except (OSError, yaml.YAMLError, ValueError, TypeError) as exc:
        print(f"composer_lightning from-trl: {path}: {exc}", file=sys.stderr)
        return 2
    lines = [
        f"# Converted from {path} (TRL GRPO config) by `python -m composer_lightning from-trl`."
    ]
    lines += [f"# {note}" for note in notes]
    sys.stdout.write("\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False))
    return 0

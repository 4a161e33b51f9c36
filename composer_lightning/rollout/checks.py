"""What the rollout callback checks at setup, before its engine starts: one line each.

The sampling temperature is set once, in the sampling settings (the module follows it); the
engine's layout must fit the ranks and the episode settings; the data's tokenizer must fit the
models, its prompts the engine's context, its minibatches its groups (`runtime/inputs.py`);
each provider must be able to judge the data's problems. The callback's own settings are
checked when it is built (`check_settings`), and a resume says each one it changes
(`setting_changes`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, NamedTuple

import lightning as L

from composer_lightning.chat import check_hint_role, check_hint_template
from composer_lightning.engines.base import GREEDY_BELOW, RolloutEngine, SamplingConfig
from composer_lightning.heads.base import HINTED_REPLIES, TEACHER_SIGNALS
from composer_lightning.rollout.hint_check import HINT_TRUST, TEACHER_REPLIES
from composer_lightning.runtime.distributed import most
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.runtime.inputs import (
    check_episode_room,
    check_minibatches,
    check_prompt_lengths,
    check_vocabulary,
    context_length,
    tokens_needed,
)
from composer_lightning.runtime.resume import line as resume_line
from composer_lightning.runtime.resume import same
from composer_lightning.tasks.registry import task_class


def follow_the_sampling_temperature(pl_module: L.LightningModule, sampling: SamplingConfig) -> None:
    """Give the module the sampling temperature, or refuse a module temperature that differs."""
    configured = getattr(pl_module, "configured_temperature", None)
    if configured is None and hasattr(pl_module, "temperature"):
        pl_module.temperature = sampling.temperature  # type: ignore[assignment]  # the one place it is set
    elif configured is not None and abs(configured - sampling.temperature) > 1e-12:
        raise ConfigError(
            f"model.temperature ({configured}) differs from rollout.sampling.temperature "
            f"({sampling.temperature}); log-probs must be those of the sampling "
            "distribution: set the sampling temperature only (the module follows it)"
        )


def check_hinted_replies(pl_module: L.LightningModule, hinted_replies: Any) -> None:
    """Hinted replies are sampled exactly when a head imitates them: one line either way."""
    objective = getattr(pl_module, "objective", None)
    if objective is None:
        return
    reader = objective.reads(HINTED_REPLIES)
    if reader and hinted_replies is None:
        raise ConfigError(
            "a head imitates replies sampled with the hint in context (context_distill), and "
            "rollout.hinted_replies is None: set it (e.g. {per_group: 1}) and a rollout.hint"
        )
    if hinted_replies is not None and not reader:
        raise ConfigError(
            "rollout.hinted_replies is set, and no head with a non-zero weight imitates the "
            "replies: add a context_distill head, or drop rollout.hinted_replies"
        )


def check_teacher_replies(replies: str) -> None:
    """`rollout.teacher_replies` is one of `TEACHER_REPLIES`: a ValueError naming it."""
    if replies not in TEACHER_REPLIES:
        raise ValueError(
            f"rollout.teacher_replies must be one of {TEACHER_REPLIES}, got {replies!r}"
        )


def check_hint_trust(
    pl_module: L.LightningModule, trust: str, hint: Any, max_staleness: int
) -> None:
    """`hint_trust: knows_better` checks each hint with the trainer's own engine, which
    generation ahead moves to another process: one line, before the engine starts."""
    if trust not in HINT_TRUST:
        raise ConfigError(f"rollout.hint_trust must be one of {HINT_TRUST}, got {trust!r}")
    objective = getattr(pl_module, "objective", None)
    teacher = objective is None or objective.reads(TEACHER_SIGNALS)
    if trust == "knows_better" and max_staleness and hint is not None and teacher:
        raise ConfigError(
            f"rollout.hint_trust: knows_better checks each hint with the trainer's engine "
            f"(the hinted teacher's greedy reply against the student's), and max_staleness="
            f"{max_staleness} runs the engine in a process of its own: set rollout.hint_trust: "
            "always (every hint used unchecked) or max_staleness: 0"
        )


def check_engine_layout(world_size: int, tp: int, max_turns: int, max_staleness: int) -> None:
    """Tensor parallelism must divide the ranks; episodes and generation ahead each exclude
    what they cannot run with."""
    if world_size % tp:
        raise ConfigError(f"tensor_parallel_size {tp} does not divide the world size {world_size}")
    if max_turns > 1 and tp > 1:
        raise ConfigError(
            f"max_turns={max_turns} with tensor_parallel_size {tp}: episodes end at different "
            "turns on different ranks, while every call of a tensor-parallel engine is a "
            "collective its ranks must make together; use tensor_parallel_size 1 (an engine per "
            "rank) for multi-turn episodes"
        )
    if max_staleness and tp > 1:
        raise ConfigError(
            f"max_staleness={max_staleness} runs each rank's engine in a process "
            f"of its own; an engine with tensor_parallel_size {tp} spans ranks: use "
            "max_staleness 0 with tensor parallelism"
        )


class RunContext(NamedTuple):
    """What the setup checks found about sequence lengths.

    Attributes:
        context: the engine's context length and where that figure comes from
            (`runtime/inputs.context_length`); None: unknown (nothing to check).
        tokens_needed: the most tokens one sequence of the run needs (`tokens_needed`),
            which the engine is given to size its context by; None: unknown.
    """

    context: tuple[int, str] | None = None
    tokens_needed: int | None = None


def check_inputs(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    engine: RolloutEngine,
    sampling: SamplingConfig,
    providers: dict[str, Any],
    max_episode_tokens: int | None = None,
    max_turns: int = 1,
) -> RunContext:
    """What `runtime/inputs.py` checks, before the engine starts: the tokenizer against the models,
    the prompts against the engine's context and `max_episode_tokens`, minibatches against
    groups; and each provider (`{"rollout.score": ..., "rollout.hint": ...,
    "rollout.val_score": ...}`) against the problems it will judge.

    Returns:
        The engine's context (for an engine that sizes its context, the size it will take for
        `tokens_needed`, which it must be given) and the run's need; both None for a data
        module of other batches (nothing to check).
    """
    dm: Any = getattr(trainer, "datamodule", None)
    if not callable(getattr(dm, "labelled_prompts", None)):
        return RunContext()
    check_minibatches(getattr(pl_module, "minibatches", 1), dm.prompts_per_step)
    check_providers(dm, providers)
    models = {name: getattr(pl_module, name, None) for name in ("policy", "teacher")}
    check_vocabulary(dm.tokenizer, models)
    prompts = list(dm.labelled_prompts())
    needed = tokens_needed(
        (len(ids) for _, ids in prompts),
        sampling.max_tokens,
        max_turns,
        max_episode_tokens,
        getattr(dm, "max_prompt_length", None),
    )
    if needed is not None:  # every rank's engine one size (a tensor-parallel group must agree)
        needed = most(needed)
    context = context_length(engine, getattr(pl_module, "policy_path", None), needed)
    check_episode_room(prompts, max_episode_tokens)
    if context is not None:
        check_prompt_lengths(prompts, sampling.max_tokens, context)
    return RunContext(context, needed)


def check_providers(dm: Any, providers: dict[str, Any]) -> None:
    """One line when a provider cannot judge the problems it will see: the score and hint
    providers on the rows of a prompt file or dataset, the validation score on its held-out
    rows. A task's own rows must name a task that resolves to it (`check_task_rows`). Providers
    that look tasks up by a row's name judge the data's task by its own instance (built with
    its `task_args`), not a fresh one built from the name."""
    task, name = getattr(dm, "task", None), getattr(dm, "task_name", None)
    for provider in providers.values():
        bind = getattr(provider, "bind_task", None)
        if task is not None and isinstance(name, str) and callable(bind):
            bind(name, task)
    if getattr(dm, "file_problems", None) is None:
        check_task_rows(dm)
        return
    problems = [dm.with_task(p) for p in dm.file_problems]
    held_out = dm.validation_problems()
    for key, provider in providers.items():
        which = held_out if key.endswith("val_score") else problems
        check = getattr(provider, "check", None)
        problem = check(which) if callable(check) and which else None
        if problem:
            raise ConfigError(
                f"{key} ({type(provider).__name__}) cannot judge this run's "
                f"{'held-out' if key.endswith('val_score') else 'training'} problems: "
                f"{problem}; give the data a task (data.task), the provider a task, or "
                "another provider"
            )


def check_task_rows(dm: Any) -> None:
    """One line when the data's task writes rows whose `"task"` does not resolve to that task
    (an unknown name, or a built-in task's name on a task of one's own), instead of every score
    call of the run failing: checked on the first batch's rows."""
    task = getattr(dm, "task", None)
    if task is None or not callable(getattr(dm, "setup_batch", None)):
        return
    for problem in dm.setup_batch().problems:
        name = problem.get("task")
        if name is None or name == dm.task_name:
            continue
        named: type | None
        try:
            named = task_class(name)
            why = f"that is {named.__module__}.{named.__qualname__}"
        except ValueError as err:
            named, why = None, str(err)
        if named is not type(task):
            raise ConfigError(
                f'data.task {dm.task_name!r} writes rows with "task": {name!r}, which does '
                f'not name it ({why}); write "task": {dm.task_name!r} in its rows, or a '
                "name no built-in task has"
            )


def check_settings(
    *,
    group_size: int,
    sampling: SamplingConfig,
    hint_role: str,
    val_samples: int,
    val_threshold: Any,
    samples_every_n_steps: int,
    samples_per_step: int,
    max_staleness: Any,
    engine_timeout: float | None,
    max_turns: Any,
    max_episode_tokens: int | None,
    hint_template: str,
    teacher_guard: Any,
) -> None:
    """ValueError naming the bad value, for the rollout callback's own settings."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
    if max_episode_tokens is not None and max_episode_tokens < 1:
        raise ValueError(f"max_episode_tokens must be >= 1 or None, got {max_episode_tokens}")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
    if engine_timeout is not None and not engine_timeout > 0:
        raise ValueError(f"engine_timeout must be > 0 seconds or None, got {engine_timeout!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    check_hint_role(hint_role)
    check_hint_template(hint_template)
    if not isinstance(teacher_guard, bool):
        raise ValueError(f"teacher_guard must be true or false, got {teacher_guard!r}")
    if sampling.greedy:
        raise ValueError(
            f"training rollouts must sample: sampling.temperature must be >= {GREEDY_BELOW} "
            f"(below it engines decode greedily), got {sampling.temperature!r}"
        )
    if val_samples < 1:
        raise ValueError(f"val_samples must be >= 1, got {val_samples}")
    if isinstance(val_threshold, bool) or not isinstance(val_threshold, (int, float)):
        raise ValueError(f"val_threshold must be a number, got {val_threshold!r}")
    if samples_every_n_steps < 0 or samples_per_step < 0:
        raise ValueError(
            f"samples_every_n_steps ({samples_every_n_steps}) and samples_per_step "
            f"({samples_per_step}) must be >= 0"
        )


def setting_changes(saved: dict[str, Any], group_size: int, sampling: SamplingConfig) -> list[str]:
    """One line per group size or sampling setting a resume changes (the configured one wins)."""
    lines = []
    if "group_size" in saved and saved["group_size"] != group_size:
        lines.append(resume_line("group_size", group_size, saved["group_size"]))
    old, mine = saved.get("sampling") or {}, asdict(sampling)
    for key in sorted(set(old) & set(mine)):
        if not same(old[key], mine[key]):
            lines.append(resume_line(f"sampling {key}", mine[key], old[key]))
    return lines

"""Resuming with a configuration that differs from the checkpoint's.

A resumed run is built from its own configuration, the command line's included (`ComposerCLI`
does not replace the `model:` section with the checkpoint's hyper-parameters, as LightningCLI
would); the checkpoint gives the state (weights, optimizer moments, head state, progress).
Where configuration and checkpoint differ, the configuration wins if that is sound, with one
warning line per difference (`resuming with lr 0.0001 (the checkpoint was trained with 0.0003)`):
- the optimizer's settings (lr, betas, weight decay, ...): Lightning restores the checkpoint's
  param groups, old settings included, so the configured ones are put back before the first
  step; with an lr scheduler the configured schedule is replayed to the step reached, so that
  the lr is what the configured optimizer and schedule give at that step;
- the lr scheduler, added, removed or with other settings (replayed the same way);
- head weights, schedules and other head settings (a head's saved state is loaded into the head
  as configured), and the module's loop settings (clip, aggregation, ppo_epochs, minibatches,
  temperature, ...);
- a frozen teacher or reference model: the configured one is used. Frozen models never change
  and are rebuilt from the configuration, so checkpoints leave them out (`leave_frozen_out`: a
  checkpoint holds the policy alone, sharded or whole); copies in older checkpoints are dropped;
- the rollout side's group size and sampling settings (`RolloutCallback`), the data's seed and
  prompts per step (`RolloutDataModule`).
What cannot be honoured is ONE `ConfigError` naming every such difference, raised by the command
line before the engine starts (and by the module when the checkpoint is loaded):
- a policy whose parameters differ in name or shape from the checkpoint's (another model; a
  policy directory that moved is honoured: the weights are the checkpoint's either way);
- another optimizer class: the saved state (Adam's moments) means nothing to another class;
- a head of another class under a saved head's name;
- a head added or removed, unless `allow_head_changes` (`--model.allow_head_changes=true`),
  which drops a removed head's saved state and starts an added head fresh (one warning line);
- another number of ranks (`training/checkpoint.py`).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from composer_lightning.runtime.distributed import world
from composer_lightning.runtime.errors import ConfigError

log = logging.getLogger(__name__)

#: Hyper-parameters compared elsewhere (heads, optimizer settings, scheduler) or not at all.
_NOT_COMPARED = frozenset({"_instantiator", "allow_head_changes", "heads", "lr_scheduler"})
#: Frozen models: the configured ones are used, never stored (`leave_frozen_out`).
FROZEN = ("reference", "teacher")
#: A scheduler's progress, as opposed to its settings.
_PROGRESS = frozenset(
    {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"}
)


@dataclass
class Differences:
    """How a run's configuration differs from its checkpoint's.

    Attributes:
        honoured: one line per difference the run takes from its configuration.
        refused: one phrase per difference it cannot honour.
    """

    honoured: list[str]
    refused: list[str]

    def raise_refused(self) -> None:
        """One ConfigError naming every refused difference, if any."""
        if self.refused:
            raise ConfigError(
                "cannot resume from this checkpoint with this configuration: "
                + "; ".join(self.refused)
            )

    def report(self) -> None:
        """The honoured differences, one warning line each (on rank 0)."""
        if world()[0] == 0:
            for line in self.honoured:
                log.warning("%s", line)


def show(value: Any) -> str:
    """A configuration value in a message: numbers as `%g`, a class_path entry as `Class(k=v)`."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict) and "class_path" in value:
        args = ", ".join(f"{k}={show(v)}" for k, v in (value.get("init_args") or {}).items())
        return f"{str(value['class_path']).rpartition('.')[2]}({args})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def line(what: str, new: Any, old: Any) -> str:
    """`resuming with <what> <new> (the checkpoint was trained with <old>)`."""
    return f"resuming with {what} {show(new)} (the checkpoint was trained with {show(old)})"


def same(a: Any, b: Any) -> bool:
    """Equal settings: tuples equal to lists, floats to 1e-12 relative."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _head_entries(heads: Any) -> dict[str, dict[str, Any]] | None:
    """Configured heads (class_path entries) by the name each head will have."""
    if not isinstance(heads, list) or not all(isinstance(h, dict) for h in heads):
        return None
    out = {}
    for entry in heads:
        args = entry.get("init_args") or {}
        name = args.get("name") or _default_name(str(entry.get("class_path")))
        out[name] = entry
    return out


def _default_name(class_path: str) -> str:
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name).default_name
    except (ImportError, AttributeError, ValueError):
        return class_path


def differences(saved: dict[str, Any], current: dict[str, Any]) -> Differences:
    """Compare the module hyper-parameters a checkpoint was trained with to this run's.

    Only settings present on both sides are compared: a module built in Python stores its plain
    settings but not the objects it was given (heads, optimizer factories, models).
    Head additions and removals are `checkpoint.load_state`'s to judge (by saved state, which
    every checkpoint has); the optimizer's settings and the scheduler are compared on the
    optimizer itself (`ConfiguredOptimizer.restore`).
    """
    out = Differences([], [])
    for key in sorted(set(saved) & set(current) - _NOT_COMPARED):
        old, new = saved[key], current[key]
        if key == "optimizer":
            old_cls, new_cls = (
                v.get("class_path") if isinstance(v, dict) else v for v in (old, new)
            )
            if old_cls != new_cls:
                out.refused.append(
                    f"optimizer {show(new_cls)} (the checkpoint was trained with {show(old_cls)}, "
                    "whose saved state means nothing to another class)"
                )
        elif same(old, new):
            continue
        elif key == "policy":
            out.honoured.append(line(key, new, old) + "; the weights are the checkpoint's")
        else:
            out.honoured.append(line(key, new, old))
    old_heads = _head_entries(saved.get("heads")) or {}
    new_heads = _head_entries(current.get("heads")) or {}
    for name in sorted(set(old_heads) & set(new_heads)):
        old, new = old_heads[name], new_heads[name]
        if old.get("class_path") != new.get("class_path"):
            new_cls, old_cls = (str(e.get("class_path")).rpartition(".")[2] for e in (new, old))
            out.refused.append(
                f"head {name} is a {new_cls} (the checkpoint's is a {old_cls}): give it another "
                "name to start it fresh"
            )
            continue
        old_args, new_args = old.get("init_args") or {}, new.get("init_args") or {}
        for arg in sorted(set(old_args) & set(new_args)):
            if not same(old_args[arg], new_args[arg]):
                out.honoured.append(line(f"{name} {arg}", new_args[arg], old_args[arg]))
    return out


def policy_mismatch(checkpoint: dict[str, Any], policy: torch.nn.Module) -> str | None:
    """What keeps the checkpoint's policy weights from loading into `policy` (names or shapes
    that differ), or None when they fit or the checkpoint holds no weights (a sharded one)."""
    state = checkpoint.get("state_dict")
    if state is None:
        return None
    saved = {
        k[len("policy.") :]: tuple(v.shape) for k, v in state.items() if k.startswith("policy.")
    }
    mine = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    if saved == mine:
        return None
    names = sorted(set(saved) ^ set(mine))
    shapes = sorted(k for k in set(saved) & set(mine) if saved[k] != mine[k])
    first = shapes[0] if shapes else names[0]
    detail = (
        f"{first} is {list(mine[first])} here, {list(saved[first])} in the checkpoint"
        if shapes
        else f"{first} is {'only here' if first in mine else 'only in the checkpoint'}"
    )
    lora = [any("lora_" in k for k in names) for names in (saved, mine)]
    if lora[0] != lora[1]:  # the names differ by peft's wrapping: say so, not which name
        detail = "the checkpoint trained " + (
            "LoRA adapters (model.peft); this run has none"
            if lora[0]
            else "the whole policy; this run has LoRA adapters (model.peft)"
        )
    return (
        f"the policy's parameters are not the checkpoint's ({len(names)} names and "
        f"{len(shapes)} shapes differ: {detail}): resume with the model the checkpoint trained"
    )


def leave_frozen_out(module: torch.nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Keep `module`'s frozen models (`FROZEN`) out of its state dict and out of what its
    `load_state_dict` reports missing: every checkpoint path (a whole file, FSDP2's sharded
    directory, `load_from_checkpoint`) then stores and loads the policy alone, and the frozen
    models stay as configured and loaded (sharded or not). The models named in `keep` change
    during training (a reference synced to the policy, `training/refsync.py`): they are
    saved and loaded like the policy."""
    left_out = tuple(f"{name}." for name in FROZEN if name not in keep)
    module._frozen_keys = left_out  # type: ignore[assignment]  # torch: attributes are Tensor | Module
    module.register_state_dict_post_hook(_drop_frozen)
    module.register_load_state_dict_post_hook(_frozen_not_missing)


def _drop_frozen(module: torch.nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
    left_out: tuple[str, ...] = module._frozen_keys  # type: ignore[assignment]  # see above
    for key in [k for k in state if k[len(prefix) :].startswith(left_out)]:
        del state[key]


def _frozen_not_missing(module: torch.nn.Module, keys: Any) -> None:
    left_out: tuple[str, ...] = module._frozen_keys  # type: ignore[assignment]  # see above
    keys.missing_keys[:] = [k for k in keys.missing_keys if not k.startswith(left_out)]


def keep_frozen(checkpoint: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
    """Drop the frozen models' copies from a whole checkpoint written before they were left out
    (`leave_frozen_out`), so that the configured ones stay; a sharded checkpoint's copies are
    never read (only the module's own state dict keys are loaded). Those named in `keep` are
    the checkpoint's to restore."""
    left_out = tuple(f"{name}." for name in FROZEN if name not in keep)
    state = checkpoint.get("state_dict") or {}
    for key in [k for k in state if k.startswith(left_out)]:
        del state[key]


@dataclass
class ConfiguredOptimizer:
    """The optimizer and scheduler settings as configured, taken before a checkpoint's replace
    them (`configure_optimizers`), to be put back once it has (`restore`).

    Attributes:
        groups: each param group's settings (no params).
        scheduler: the scheduler's `state_dict` as built, or None without a scheduler.
    """

    groups: list[dict[str, Any]]
    scheduler: dict[str, Any] | None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, scheduler: Any) -> ConfiguredOptimizer:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(groups, None if scheduler is None else dict(scheduler.state_dict()))

    def restore(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        replay: Any,
        steps: int,
        saved_scheduler: bool,
    ) -> list[str]:
        """Put the configured settings back into `optimizer` (and `scheduler`), after Lightning
        loaded a checkpoint's.

        Args:
            replay: `() -> (optimizer, scheduler)`, a fresh configured pair on stand-in
                parameters, stepped here `steps` times to reach the lr of the step resumed at.
            steps: scheduler steps taken so far (one per optimizer step).
            saved_scheduler: the checkpoint has a scheduler's state.

        Returns:
            One line per difference from the checkpoint's settings.
        """
        lines = []
        for group, fresh in zip(optimizer.param_groups, self.groups, strict=True):
            old = group.get("initial_lr", group["lr"]) if saved_scheduler else group["lr"]
            new = fresh.get("initial_lr", fresh["lr"])
            if not same(old, new):
                lines.append(line("lr", new, old))
            group["lr"] = fresh["lr"]
            for key in sorted(set(fresh) - {"lr", "initial_lr"}):
                if key in group and not same(group[key], fresh[key]):
                    lines.append(line(key, fresh[key], group[key]))
                group[key] = fresh[key]
        if scheduler is None:
            if saved_scheduler:
                lines.append(
                    "resuming without an lr scheduler (the checkpoint was trained with one)"
                )
            return _unique(lines)
        if not saved_scheduler:
            lines.append("resuming with an lr scheduler (the checkpoint was trained without one)")
        else:
            assert self.scheduler is not None  # configured with a scheduler, as resumed with one
            restored = scheduler.state_dict()
            for key in sorted(set(self.scheduler) - _PROGRESS - {"base_lrs"}):
                if key in restored and not same(restored[key], self.scheduler[key]):
                    lines.append(line(f"lr_scheduler {key}", self.scheduler[key], restored[key]))
        stand_in, schedule = replay()
        with warnings.catch_warnings():  # stepping a schedule without optimizer steps, on purpose
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                schedule.step()
        scheduler.load_state_dict(schedule.state_dict())
        for group, replayed in zip(optimizer.param_groups, stand_in.param_groups, strict=True):
            group.update({k: v for k, v in replayed.items() if k != "params"})
        return _unique(lines)


def _unique(lines: list[str]) -> list[str]:
    """One line per difference, not per param group."""
    return list(dict.fromkeys(lines))

"""Checks of the rollout side's inputs against the models, at setup, before any engine starts.

Each is one `ConfigError` line naming the bad value and what was expected, where the run would
otherwise fail later with a long traceback (an `IndexError` in the first forward, vLLM's
refusal of a prompt after the engine started, a minibatch split that cannot be made):
- a tokenizer whose ids do not fit a model's embedding (`check_vocabulary`);
- a prompt that leaves no room for `max_tokens` in the engine's context (`check_prompt_lengths`,
  with the context from `context_length`): every line of a prompt file at setup, naming file and
  line; a task's prompts at setup (the first batch) and before each batch is generated. An
  engine that sizes its own context (`VLLMEngine` without `max_model_len`) is given the figure
  these checks use (`sized_context` of `tokens_needed`), so engine and checks agree;
- a prompt that leaves no room for a reply in `max_episode_tokens` (`check_episode_room`), at
  the same places;
- more minibatches than groups per rollout batch (`check_minibatches`);
- Lightning's automatic-optimisation options on a manually optimised module
  (`check_trainer_options`), which Lightning refuses with a traceback that names no option of
  ours.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from composer_lightning.runtime.errors import ConfigError

#: Config fields that hold a model's context length, in the order vLLM reads them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")

#: A context sized for the run is a whole number of blocks of this many tokens.
CONTEXT_BLOCK = 256


def check_vocabulary(tokenizer: Any, models: dict[str, nn.Module | None]) -> None:
    """ConfigError unless every id the tokenizer can produce has a row in each model's input
    embedding (rows beyond the tokenizer's ids are fine: embeddings are often padded)."""
    ids = len(tokenizer)
    for name, model in models.items():
        embed = getattr(model, "get_input_embeddings", lambda: None)() if model else None
        rows = getattr(embed, "num_embeddings", None)
        if rows is not None and ids > rows:
            raise ConfigError(
                f"the tokenizer has {ids} token ids but the {name}'s embedding has {rows} rows "
                f"(ids >= {rows} would index past it): use the {name}'s own tokenizer"
            )


def context_length(
    engine: Any, policy_path: str | None, needed: int | None = None
) -> tuple[int, str] | None:
    """The most tokens (prompt + completion) the engine will hold, and where that figure comes
    from: a configured `max_model_len`; else, for an engine that sizes its context to the run
    (its `sizes_context` is true) and a known need, `sized_context(needed, the model's)`; else
    the engine model's config (its `max_position_embeddings`); None when none is known.

    Args:
        needed: the tokens the run needs (`tokens_needed`); None: not known.
    """
    configured = (getattr(engine, "llm_kwargs", None) or {}).get(
        "max_model_len", getattr(engine, "max_model_len", None)
    )
    if configured:
        return int(configured), f"{type(engine).__name__} max_model_len"
    own = model_context(engine, policy_path)
    if needed is not None and getattr(engine, "sizes_context", False):
        limit = None if own is None else own[0]
        sized = sized_context(needed, limit)
        at_most = "" if own is None or sized < own[0] else f", the model's maximum ({own[1]})"
        return sized, (
            f"{type(engine).__name__}'s context sized for the run: {needed} tokens needed, "
            f"doubled, in blocks of {CONTEXT_BLOCK}{at_most}; set max_model_len to choose it"
        )
    return own


def model_context(engine: Any, policy_path: str | None) -> tuple[int, str] | None:
    """The engine model's own context length (its config's `max_position_embeddings`, or the
    like, times a RoPE scaling factor) and where it comes from; None when unknown."""
    model = getattr(engine, "model", None) or getattr(engine, "_source", None)
    path = getattr(engine, "model_path", None) or policy_path
    config = getattr(model, "config", None)
    if config is None and path is not None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError):  # not a readable model directory: nothing to check
            return None
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value * _rope_factor(config), f"{key} of {path or type(model).__name__}"
    return None


def sized_context(needed: int, limit: int | None) -> int:
    """The context an engine without a configured one holds: twice what the run is known to
    need, since prompts not seen at setup (a task's later batches, held-out prompts, hinted
    contexts) may be longer, in whole blocks of `CONTEXT_BLOCK` tokens; never above the model's
    own `limit`. The headroom is cheap: an engine's KV cache is sized apart (vLLM only checks
    that one sequence of this length fits in it)."""
    sized = -(-2 * needed // CONTEXT_BLOCK) * CONTEXT_BLOCK
    return sized if limit is None else min(sized, limit)


def tokens_needed(
    prompt_lengths: Iterable[int],
    max_tokens: int,
    max_turns: int = 1,
    max_episode_tokens: int | None = None,
    max_prompt_length: int | None = None,
) -> int | None:
    """The most tokens one sequence of the run needs: the longest prompt (at most
    `max_prompt_length`, to which prompts are cut) plus `max_tokens`, capped by the episode
    budget; for multi-turn episodes the budget itself (None without one: unknown).

    Args:
        prompt_lengths: the token counts of the prompts known at setup.
        max_tokens: the completion budget of one turn (`sampling.max_tokens`).
        max_turns: assistant turns per episode.
        max_episode_tokens: the episode's token budget, prompt included; None: none.
        max_prompt_length: the data's prompt cut; None: none.
    """
    if max_turns > 1:
        return max_episode_tokens
    # prompts are cut to max_prompt_length: a bound on every prompt, seen or not
    longest = max_prompt_length or max(prompt_lengths, default=0)
    needed = longest + max_tokens
    return needed if max_episode_tokens is None else min(needed, max_episode_tokens)


def _rope_factor(config: Any) -> int:
    """The context extension of a scaled RoPE (linear, dynamic, YaRN), as vLLM applies it."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return 1
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    if kind in ("linear", "dynamic", "yarn") and isinstance(factor, (int, float)) and factor > 1:
        return int(factor)
    return 1


def check_prompt_lengths(
    prompts: Iterable[tuple[str, list[int]]], max_tokens: int, context: tuple[int, str]
) -> None:
    """ConfigError naming the first prompt (and how many more) for which prompt + `max_tokens`
    exceeds the engine's context.

    Args:
        prompts: `(where, prompt ids)` pairs; `where` names the prompt ("prompts.jsonl:12").
        max_tokens: the completion budget (`sampling.max_tokens`).
        context: `context_length`'s figure and source.
    """
    limit, source = context
    long = [(where, len(ids)) for where, ids in prompts if len(ids) + max_tokens > limit]
    if long:
        where, n = long[0]
        more = f" (and {len(long) - 1} more prompts)" if len(long) > 1 else ""
        raise ConfigError(
            f"prompt {where} has {n} tokens: with max_tokens {max_tokens} it needs {n + max_tokens}"
            f" positions, more than the engine's context of {limit} ({source}){more}; shorten the "
            "prompt or lower sampling.max_tokens"
        )


def check_episode_room(
    prompts: Iterable[tuple[str, list[int]]], max_episode_tokens: int | None
) -> None:
    """ConfigError naming the first prompt (and how many more) with no room left for a reply
    within `max_episode_tokens` (the whole episode's tokens, prompt included)."""
    if max_episode_tokens is None:
        return
    full = [(where, len(ids)) for where, ids in prompts if len(ids) >= max_episode_tokens]
    if full:
        where, n = full[0]
        more = f" (and {len(full) - 1} more prompts)" if len(full) > 1 else ""
        raise ConfigError(
            f"prompt {where} has {n} tokens, no room for a reply within "
            f"rollout.max_episode_tokens={max_episode_tokens}{more}; raise max_episode_tokens "
            "above the longest prompt or shorten the prompt"
        )


def check_minibatches(minibatches: int, groups: int) -> None:
    """ConfigError unless a rollout batch of `groups` groups splits into `minibatches`."""
    if minibatches > groups:
        raise ConfigError(
            f"model.minibatches={minibatches} but a rollout batch has {groups} groups (one per "
            f"prompt: data.prompts_per_step); minibatches split along groups: set minibatches "
            f"<= {groups}"
        )


def check_trainer_options(
    trainer: Any, micro_batches: bool = False, skip_signal_free: bool = False
) -> None:
    """ConfigError naming the option to use instead of `trainer.gradient_clip_val` or
    `trainer.accumulate_grad_batches` in a fit: the module steps its optimizer itself (manual
    optimisation), where Lightning applies neither. With `skip_signal_free`, one under fp16's
    grad scaler (`16-mixed`), whose step needs a gradient. With `micro_batches`, also one under
    `DDPStrategy`: the micro-batched step's backwards bypass Lightning's DDP bookkeeping
    (`manual_backward`), so gradients would not be reduced as DDP expects.

    Called from `ComposerModule.configure_callbacks`, the last hook before Lightning checks the
    loop configuration."""
    if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
        return
    from lightning.pytorch.strategies import DDPStrategy

    if micro_batches and isinstance(getattr(trainer, "strategy", None), DDPStrategy):
        raise ConfigError(
            "model.max_tokens_per_micro_batch / model.micro_batch_size are not supported under "
            "DDPStrategy: use ModelParallelStrategy (FSDP2, gradients reduced once per "
            "optimizer step) or one device, or leave micro-batches off"
        )
    precision = str(getattr(trainer, "precision", ""))
    if skip_signal_free and precision == "16-mixed":
        raise ConfigError(
            "model.skip_signal_free_updates needs an optimizer step without a gradient, which "
            "fp16's grad scaler (trainer.precision=16-mixed) refuses: use bf16-mixed or fp32, "
            "or leave it off"
        )
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip is not None and clip > 0:
        raise ConfigError(
            f"trainer.gradient_clip_val={clip:g} does not apply (the module steps its optimizer "
            f"itself): set model.max_grad_norm={clip:g} instead (default 1.0; null: no clipping)"
        )
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate} does not apply (the module steps its "
            "optimizer itself): an optimizer step sees a whole minibatch of a rollout batch, "
            "forwarded in micro-batches of model.max_tokens_per_micro_batch tokens or "
            "model.micro_batch_size rows with its gradients accumulated; set one of those "
            "(data.prompts_per_step sets the batch)"
        )

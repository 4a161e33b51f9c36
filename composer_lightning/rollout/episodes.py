"""The episode loop: an agent's turns through the engine, on token ids.

An episode is one or more assistant turns. Turn 1 of every episode of a problem is generated
from the problem's opening context (`n = G` samples, as a single-turn rollout is); each later
turn from the episode's own token ids. After a turn the environment answers with an
`Observation`, and its messages are appended as the chat template's *token delta*:

    delta = render(chat + [assistant] + observation, generation prompt)[len(render(chat + [assistant])):]

so earlier turns are never re-tokenised: the engine's own ids of every assistant turn stay as
they were sampled (they are what the log-probs are of). The template must be prefix-stable for
this (rendering a chat gives a token prefix of rendering it with more messages): one that is
not (one that rewrites earlier turns, e.g. drops the reasoning of past assistant turns) is a
`ValueError` naming the turn, never a silent misalignment. The concatenation equals the
template of the whole conversation whenever the engine's ids of each assistant turn are the
tokenisation of their text; when they are not (a sampled id sequence the tokenizer would spell
differently), the episode keeps the engine's ids and counts the difference
(`episode/retokenized_differently`).

Limits: `max_turns` assistant turns (then the episode ends, `status="max_turns"`); a token
budget per episode and the engine's context length (a turn gets at most what is left; an
episode with nothing left, or whose turn hit `max_tokens`, ends `status="truncated"`). An
environment with an `end(messages)` method gives such an episode its outcome (`envs/base.py`). An
environment that raises, times out (`env_timeout` per call) or returns something that is not an
`Observation` of chat messages fails its episode (`status="failed"`, one warning line each);
the other episodes go on.

An environment whose `tool_call_format` is "template" reads calls in the format the tokenizer's
chat template writes (`chat.tool_calls.format_of_template`), set here when it is made.

Environments of different episodes are called concurrently, up to `env_workers` calls at a time
on threads (each episode has its own environment instance): a turn's tool calls that take real
time (a search, a sandbox) wait side by side, not one after another, and a hung one fails only
its own episode after `env_timeout`. Everything else (tokenising, the token deltas) stays on the
caller's thread, in the batch's order, so the episodes are the same whatever the concurrency.

Why this file is long: the loop is one state machine over a batch of episodes (openings and
their groups, token budgets, the environment calls, template deltas, limits and failures), and
its rules hold only read together; what it hands on (`Episode`, `Turn`) is defined beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

from composer_lightning.chat import render_ids, template_delta
from composer_lightning.chat.tool_calls import format_of_template
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.envs.base import (
    Environment,
    Message,
    Observation,
    SingleTurn,
    checked_observation,
    checked_opening,
)
from composer_lightning.runtime.calls import CallTimeout, call_all

log = logging.getLogger(__name__)

Generate = Callable[[list[list[int]], int, SamplingConfig], list[list[Completion]]]


@dataclass
class Turn:
    """One assistant turn of an episode.

    Attributes:
        context: the chat before the turn (what the model saw, as messages).
        context_ids: the token ids before the turn (generation prompt included).
        completion: the engine's completion (ids, log-probs, finish reason).
        text: the decoded turn.
        next_state: the environment's answer to it (None: the turn ended the episode without
            one, or the episode failed at it).
    """

    context: list[Message]
    context_ids: list[int]
    completion: Completion
    text: str
    next_state: Observation | None = None

    @property
    def has_next_state(self) -> bool:
        """Whether messages followed the turn (a tool result or error, a user's reply)."""
        return self.next_state is not None and bool(self.next_state.messages)


@dataclass
class Episode:
    """One episode: its problem, turns, whole chat, outcome and how it ended.

    Attributes:
        problem: the problem it was drawn on.
        turns: the assistant turns, in order.
        messages: the whole chat (opening, assistant turns, observations).
        tools: the tool specs the model was shown (None: none).
        reward: the environment's outcome reward (None: the run's score provider decides).
        status: "done" (the environment ended it), "max_turns", "truncated" (token budget or
            context exhausted, or a turn cut at `max_tokens`) or "failed".
        error: why it failed, or None.
        retokenized_differently: the episode's ids differ from the template of its chat.
    """

    problem: dict[str, Any]
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    reward: float | None = None
    status: str = "running"
    error: str | None = None
    retokenized_differently: bool = False
    env: Any = field(default=None, repr=False)
    ids: list[int] = field(default_factory=list, repr=False)

    @property
    def alive(self) -> bool:
        return self.status == "running"

    def fail(self, why: str) -> None:
        self.status, self.error = "failed", why
        log.warning("episode on %s failed: %s", _problem_label(self.problem), why)


def _problem_label(problem: dict[str, Any]) -> str:
    text = str(problem.get("prompt") or (problem.get("messages") or [{}])[-1].get("content", ""))
    return repr(text[:60])


def run_episodes(
    generate: Generate,
    problems: list[dict[str, Any]],
    prompt_ids: list[list[int]],
    environment: Callable[[dict[str, Any]], Environment],
    tokenizer: Any,
    sampling: SamplingConfig,
    group_size: int,
    max_turns: int = 1,
    max_episode_tokens: int | None = None,
    context_length: int | None = None,
    env_timeout: float | None = 30.0,
    env_workers: int = 32,
) -> list[list[Episode]]:
    """`group_size` episodes of each problem, turn by turn (see the module docstring).

    Args:
        generate: `(prompts, n, sampling) -> completions` through the run's engine.
        problems: the batch's problems.
        prompt_ids: each problem's opening ids as the data module tokenised them; used for a
            single-turn environment (so a single-turn task samples exactly as before), while a
            multi-turn environment's opening is rendered from its `reset` chat and tools.
        environment: a fresh environment per episode (`Task.environment`).
        sampling: the turn's sampling settings; its `seed` is that of the whole call: turn k
            samples with `seed + k * len(problems) * group_size` (the caller reserves
            `max_turns` such ranges).
        max_turns: assistant turns per episode at most.
        max_episode_tokens: tokens of the whole episode (prompt included) at most; None: no
            budget beyond the engine's context.
        context_length: the engine's context (a turn never exceeds it); None: unknown.
        env_timeout: seconds per environment call (None: no limit).
        env_workers: environment calls (resets, steps) of different episodes in flight at once;
            1: one after another.

    Returns:
        `result[i]`: the episodes of `problems[i]`.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    G = group_size
    episodes = [[Episode(problem=p) for _ in range(G)] for p in problems]
    for problem, group in zip(problems, episodes, strict=True):
        for ep in group:
            try:
                ep.env = environment(problem)
                if getattr(ep.env, "tool_call_format", None) == "template":
                    ep.env.tool_call_format = format_of_template(tokenizer)
            except Exception as exc:  # a broken environment fails its episode
                ep.fail(f"reset raised {type(exc).__name__}: {exc}")
    started = [(i, ep) for i, group in enumerate(episodes) for ep in group if ep.alive]
    resets = call_all(
        [(ep.env.reset, (problems[i],), _limit(ep, env_timeout)) for i, ep in started],
        env_workers,
    )
    for (i, ep), (opening, error) in zip(started, resets, strict=True):
        try:
            if error is not None:
                raise error
            ep.messages = checked_opening(opening)
            ep.tools = getattr(ep.env, "tools", None)
            if isinstance(ep.env, SingleTurn):
                ep.ids = list(prompt_ids[i])
            else:
                ep.ids = render_ids(tokenizer, ep.messages, True, tools=ep.tools)
        except CallTimeout:
            ep.fail(f"reset timed out after {env_timeout:g} s")
        except Exception as exc:  # a broken environment fails its episode
            ep.fail(f"reset raised {type(exc).__name__}: {exc}")
    openings: list[list[int] | None] = []
    for group in episodes:
        first: list[int] | None = None
        for ep in group:
            if not ep.alive:
                continue
            if first is None:
                first = ep.ids
            elif ep.ids != first:
                ep.fail("reset gave another opening than the group's first episode")
        openings.append(first)
    stride = len(problems) * G
    for turn in range(max_turns):
        seed = None if sampling.seed is None else sampling.seed + turn * stride
        if turn == 0:  # G samples of each problem's opening: a single-turn rollout's call
            # Openings differ in length: problems are bucketed by the room each has left (one
            # call when all have the same, as a single-turn rollout), never cut to the batch's
            # shortest; a problem with no room fails its episodes.
            rooms: dict[int, list[int]] = {}
            for i, ids in enumerate(openings):
                group = [ep for ep in episodes[i] if ep.alive]
                if ids is None or not group:
                    continue
                left = _budget(group[0], sampling, max_episode_tokens, context_length)
                if left < 1:
                    for ep in group:
                        ep.fail(_no_room(len(ids), max_episode_tokens, context_length))
                    continue
                rooms.setdefault(left, []).append(i)
            results: list[tuple[Episode, Completion]] = []
            offset = 0
            for left, asked in sorted(rooms.items()):
                call_seed = None if seed is None else seed + offset
                offset += len(asked) * G
                outs = generate(
                    [cast(list[int], openings[i]) for i in asked],  # asked: not None
                    G,
                    replace(sampling, seed=call_seed, max_tokens=left),
                )
                for i, replies in zip(asked, outs, strict=True):
                    results.extend(
                        (ep, c) for ep, c in zip(episodes[i], replies, strict=True) if ep.alive
                    )
        else:
            running = [ep for group in episodes for ep in group if ep.alive]
            if not running:
                break
            results = []
            offset = 0
            by_budget: dict[int, list[Episode]] = {}
            for ep in running:
                left = _budget(ep, sampling, max_episode_tokens, context_length)
                if left < 1:
                    ep.status = "truncated"
                    continue
                by_budget.setdefault(left, []).append(ep)
            for left, eps in sorted(by_budget.items()):
                call_seed = None if seed is None else seed + offset
                offset += len(eps)
                outs = generate(
                    [ep.ids for ep in eps], 1, replace(sampling, seed=call_seed, max_tokens=left)
                )
                results.extend((ep, group[0]) for ep, group in zip(eps, outs, strict=True))
        _advance(results, tokenizer, env_timeout, turn == max_turns - 1, env_workers)
    ended = [
        ep
        for group in episodes
        for ep in group
        if ep.status in ("truncated", "max_turns", "running")
        and ep.reward is None
        and callable(getattr(ep.env, "end", None))
    ]
    outcomes = call_all(
        [(ep.env.end, (list(ep.messages),), _limit(ep, env_timeout)) for ep in ended], env_workers
    )
    for ep, (reward, error) in zip(ended, outcomes, strict=True):
        if ep.status == "running":
            ep.status = "max_turns"
        if error is not None:
            ep.fail(f"end raised {type(error).__name__}: {error}")
        elif reward is not None:
            ep.reward = float(reward)
    for group in episodes:
        for ep in group:
            ep.env = None  # environments are per episode: nothing of them outlives it
    return episodes


def _budget(
    ep: Episode, sampling: SamplingConfig, max_episode_tokens: int | None, context: int | None
) -> int:
    left = sampling.max_tokens
    for limit in (max_episode_tokens, context):
        if limit is not None:
            left = min(left, limit - len(ep.ids))
    return left


def _no_room(n: int, max_episode_tokens: int | None, context: int | None) -> str:
    limits = [
        f"{name} {limit}"
        for name, limit in (("max_episode_tokens", max_episode_tokens), ("context", context))
        if limit is not None and n >= limit
    ]
    return f"its opening has {n} tokens: no room for a reply within {' and '.join(limits)}"


def _limit(ep: Episode, env_timeout: float | None) -> float | None:
    """An environment call's timeout: none for a single turn (nothing to wait for)."""
    return None if isinstance(ep.env, SingleTurn) else env_timeout


def _advance(
    results: list[tuple[Episode, Completion]],
    tokenizer: Any,
    timeout: float | None,
    last: bool,
    workers: int,
) -> None:
    """Record each episode's turn, ask the environments for the next states (concurrently,
    `call_all`), then append each delta, in order."""
    asked = []
    for ep, c in results:
        assistant = _record(ep, c, tokenizer)
        if assistant is not None:
            asked.append((ep, assistant))
    steps = call_all(
        [(ep.env.step, (assistant,), _limit(ep, timeout)) for ep, assistant in asked], workers
    )
    for (ep, _), (obs, error) in zip(asked, steps, strict=True):
        _observe(ep, obs, error, tokenizer, timeout, last)


def _record(ep: Episode, c: Completion, tokenizer: Any) -> Message | None:
    """Record turn `c` of `ep`; the assistant message for the environment, or None when the
    turn was cut mid-way (nothing an environment could answer)."""
    text = c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
    turn = Turn(list(ep.messages), list(ep.ids), c, text)
    ep.turns.append(turn)
    assistant = {"role": "assistant", "content": text}
    ep.messages.append(assistant)
    ep.ids = ep.ids + list(c.token_ids)
    if c.finish_reason == "length":
        ep.status = "truncated"
        return None
    return assistant


def _observe(
    ep: Episode,
    obs: Any,
    error: Exception | None,
    tokenizer: Any,
    timeout: float | None,
    last: bool,
) -> None:
    """The environment's answer to `ep`'s last turn: the next state and its token delta, the
    episode's end, or its failure."""
    if isinstance(error, CallTimeout):
        ep.fail(f"step timed out after {timeout:g} s")
        return
    try:
        if error is not None:
            raise error
        obs = checked_observation(obs)
    except Exception as exc:
        ep.fail(f"step raised {type(exc).__name__}: {exc}")
        return
    turn = ep.turns[-1]
    turn.next_state = obs
    if obs.done or last:
        ep.reward = None if obs.reward is None else float(obs.reward)
        ep.status = "done" if obs.done else "max_turns"
        if obs.messages and not obs.done:
            ep.messages.extend(obs.messages)
        return
    if not obs.messages:
        ep.fail("step returned no messages and did not end the episode")
        return
    delta = template_delta(tokenizer, ep.messages, obs.messages, ep.tools)  # or a ValueError
    ep.messages.extend(obs.messages)
    ep.ids = ep.ids + _tail(tokenizer, ep, turn) + delta
    if not isinstance(ep.env, SingleTurn):
        whole = render_ids(tokenizer, ep.messages, True, tools=ep.tools)
        ep.retokenized_differently |= whole != ep.ids


def _tail(tokenizer: Any, ep: Episode, turn: Turn) -> list[int]:
    """What the template puts after an assistant turn's stop token (e.g. a newline after
    `<|im_end|>`), which the engine stopped before generating."""
    rendered = render_ids(tokenizer, ep.messages, False, tools=ep.tools)
    ids = turn.completion.token_ids
    if not ids:
        return []
    stop = ids[-1]
    where = (
        len(rendered) - 1 - rendered[::-1].index(stop) if stop in rendered else len(rendered) - 1
    )
    return rendered[where + 1 :]


def one_turn_episodes(
    problems: list[dict[str, Any]],
    prompt_ids: list[list[int]],
    outs: list[list[Completion]],
    tokenizer: Any,
) -> list[list[Episode]]:
    """Single-turn episodes of completions already sampled (`outs[i]`: those of problem i), as
    `run_episodes` makes them with `SingleTurn` environments."""
    from composer_lightning.chat import problem_messages

    episodes = []
    for problem, ids, group in zip(problems, prompt_ids, outs, strict=True):
        row = []
        for c in group:
            text = (
                c.text
                if c.text is not None
                else tokenizer.decode(c.token_ids, skip_special_tokens=True)
            )
            context = problem_messages(problem)
            turn = Turn(context, list(ids), c, text, Observation(done=True))
            status = "truncated" if c.finish_reason == "length" else "done"
            messages = [*context, {"role": "assistant", "content": text}]
            row.append(
                Episode(problem, [turn], messages, status=status, ids=list(ids) + list(c.token_ids))
            )
        episodes.append(row)
    return episodes


def episode_state(ep: Episode) -> dict[str, Any]:
    """`ep` as plain data (dicts and lists) for a checkpoint; its environment is not kept (an
    episode held there has ended)."""
    state = asdict(replace(ep, env=None))
    del state["env"]
    return state


def episode_from_state(state: dict[str, Any]) -> Episode:
    """The episode `episode_state` gave."""
    turns = [
        Turn(
            t["context"],
            t["context_ids"],
            Completion(**t["completion"]),
            t["text"],
            None if t["next_state"] is None else Observation(**t["next_state"]),
        )
        for t in state["turns"]
    ]
    return Episode(**{**state, "turns": turns})


def task_environments(
    default: Any = None, default_name: str | None = None
) -> Callable[[dict[str, Any]], Environment]:
    """Per episode a fresh environment from the problem's task (`Task.environment`): its
    `"task"` field names it, else `default` (the data's task, also named `default_name`, e.g.
    by the dotted path it was built from with its arguments); neither: a single turn."""
    from composer_lightning.tasks import get_task

    tasks: dict[str, Any] = {}
    own = {getattr(default, "name", None), default_name} - {None}

    def environment(problem: dict[str, Any]) -> Environment:
        name = problem.get("task")
        task = default
        if isinstance(name, str) and name not in own:
            if name not in tasks:
                tasks[name] = get_task(name)
            task = tasks[name]
        return task.environment(problem) if task is not None else SingleTurn()

    return environment


@dataclass
class EpisodeSettings:
    """The rollout callback's episode limits (see `run_episodes`), and the engine's context
    length once setup knows it."""

    max_turns: int = 1
    max_episode_tokens: int | None = None
    env_timeout: float | None = 30.0
    context_length: int | None = None
    env_workers: int = 32

    def run(
        self,
        generate: Generate,
        dm: Any,
        problems: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingConfig,
    ) -> list[list[Episode]]:
        """`n` episodes of each of `dm`'s problems through `generate` (`run_episodes`), each in
        the environment of its task (`task_environments`, the data's task by default)."""
        return run_episodes(
            generate,
            problems,
            prompt_ids,
            task_environments(getattr(dm, "task", None), getattr(dm, "task_name", None)),
            dm.tokenizer,
            sampling,
            n,
            self.max_turns,
            self.max_episode_tokens,
            self.context_length,
            self.env_timeout,
            self.env_workers,
        )

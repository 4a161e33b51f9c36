"""`examples/openenv_lookup`: a user's own OpenEnv environment, tested as a user writes and runs
it — under OpenEnv's own loop and through the library on the same scripted episode, then its
config trained from another working directory with the example on `PYTHONPATH`."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("openenv.core.harness")

from openenv.core.harness import (  # noqa: E402
    HarnessRunLimits,
    MCPHarnessAdapter,
    ModelStepResult,
    _resolve_env_reward,
)
from openenv.core.llm_client import LLMResponse  # noqa: E402
from openenv.core.llm_client import ToolCall as OEToolCall  # noqa: E402

from composer_lightning.models.tiny import tiny_tool_policy_path  # noqa: E402
from composer_lightning.tasks import get_task  # noqa: E402
from tests.helpers import ROOT  # noqa: E402
from tests.test_custom_env import train_example_elsewhere  # noqa: E402

EXAMPLE = ROOT / "examples" / "openenv_lookup"


@pytest.fixture()
def lookup_env(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import lookup_env

    yield lookup_env
    sys.modules.pop("lookup_env", None)


def _openenv_reward(factory, seed, script) -> float:
    """The episode under OpenEnv's own white-box loop, the model's turns scripted."""
    turns = iter(script)

    def model_step(messages, tools, sampling):
        content, calls = next(turns)
        tool_calls = [OEToolCall(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)]
        return ModelStepResult(response=LLMResponse(content=content, tool_calls=tool_calls))

    session = factory.create(task=None, seed=seed)
    rollout = MCPHarnessAdapter().run_white_box(model_step, session, HarnessRunLimits(max_turns=3))
    return _resolve_env_reward(rollout, session.verify(rollout.messages))


def test_the_same_episode_scores_alike_under_openenv_and_here(lookup_env):
    """A lookup, then the price: 1.0 under both loops; an unknown item is the turn's tool error
    naming the items there are (the episode goes on); a wrong price scores 0.0 under both."""
    task = get_task(
        "composer_lightning.tasks.openenv.OpenEnvTask",
        factory="lookup_env:LookupSessions",
        max_turns=3,
        tool_call_format="hermes",
    )
    (problem,) = task.samples(1, seed=0)
    session = lookup_env.LookupSessions().create(None, seed=problem["seed"])
    item, price = session.item, session.prices[session.item]
    env = task.environment(problem)
    opening = env.reset(problem)
    assert opening[0]["content"].startswith(f"How much does {item} cost")
    assert [t["function"]["name"] for t in env.tools] == ["lookup"]
    call = {"name": "lookup", "arguments": {"item": "caviar"}}
    unknown = env.step(
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"}
    )
    assert not unknown.done and unknown.tool_error.startswith("no item 'caviar' in the price list")
    call = {"name": "lookup", "arguments": {"item": item}}
    found = env.step({"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"})
    assert found.messages[0]["content"] == str(price) and found.tool_error is None
    end = env.step({"role": "assistant", "content": f"It costs {price}."})
    assert (end.done, end.reward) == (True, 1.0)
    script = [("", [("lookup", {"item": item})]), (f"It costs {price}.", [])]
    assert _openenv_reward(lookup_env.LookupSessions(), problem["seed"], script) == 1.0
    wrong = [("", [("lookup", {"item": item})]), (f"It costs {price + 1}.", [])]
    assert _openenv_reward(lookup_env.LookupSessions(), problem["seed"], wrong) == 0.0
    env = task.environment(problem)
    env.reset(problem)
    assert env.step({"role": "assistant", "content": f"It costs {price + 1}."}).reward == 0.0


@pytest.mark.slow  # a fit through the command line
def test_the_examples_config_trains_from_another_directory(tmp_path):
    """Copied elsewhere, run as the README says: held-out episode success before the first step
    and after it, the session's tool in the rollouts written."""
    episode = train_example_elsewhere(EXAMPLE, "openenv_lookup", tmp_path)
    assert [t["function"]["name"] for t in episode["tools"]] == ["lookup"]
    assert episode["messages"][0]["content"].startswith("How much does")


def test_an_episode_cut_at_the_token_budget_gets_the_sessions_own_verdict(lookup_env):
    """The loop ends an episode the session did not end (its turn hit `max_tokens`): the
    session's `verify` on the transcript with the cut turn gives the outcome, right or wrong,
    not the run's score provider (which has no verifier for OpenEnv)."""
    from transformers import AutoTokenizer

    from composer_lightning.engines.base import Completion, SamplingConfig
    from composer_lightning.rollout.episodes import run_episodes

    task = get_task(
        "composer_lightning.tasks.openenv.OpenEnvTask", factory="lookup_env:LookupSessions"
    )
    problems = task.samples(2, seed=1)
    prices = []
    for p in problems:
        session = lookup_env.LookupSessions().create(None, seed=p["seed"])
        prices.append(session.prices[session.item])
    tokenizer = AutoTokenizer.from_pretrained(tiny_tool_policy_path())
    replies = iter([f"It costs {prices[0]} and", f"It costs {prices[1] + 1} and"])

    def generate(prompts, n, sampling):
        out = []
        for _ in prompts:
            text = next(replies)
            ids = tokenizer.encode(text, add_special_tokens=False)
            out.append([Completion(ids, [0.0] * len(ids), "length", text)] * n)
        return out

    episodes = run_episodes(
        generate, problems, [[], []], task.environment, tokenizer, SamplingConfig(max_tokens=8),
        1, 3,
    )  # fmt: skip
    assert [(g[0].status, g[0].reward) for g in episodes] == [
        ("truncated", 1.0),
        ("truncated", 0.0),
    ]

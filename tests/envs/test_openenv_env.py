"""`OpenEnvEpisode` / `OpenEnvTask` against OpenEnv's own echo environment.

The environment is the one `openenv init` scaffolds (`EchoEnvironment`: the reward of a step
is 0.1 per character echoed, it never ends by itself), served by OpenEnv's own `create_app`
on a loopback port and reached by its generated WebSocket client, through OpenEnv's
`StepEnvSessionAdapter`: the path a user takes with an OpenEnv environment of their own. The
same scripted turns run through OpenEnv's white-box loop (`MCPHarnessAdapter`) give the
transcript and reward the adapter is checked against.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time

import pytest

pytest.importorskip("openenv.core.harness")

from openenv.core.env_server.mcp_types import Tool  # noqa: E402
from openenv.core.harness import (  # noqa: E402
    HarnessRunLimits,
    MCPHarnessAdapter,
    ModelStepResult,
    ResourceSessionFactory,
    StepEnvSessionAdapter,
    _resolve_env_reward,
)
from openenv.core.llm_client import LLMResponse  # noqa: E402
from openenv.core.llm_client import ToolCall as OEToolCall  # noqa: E402

from composer_lightning.envs import Environment  # noqa: E402
from composer_lightning.envs.openenv_env import OpenEnvEpisode, parse_tool_calls  # noqa: E402
from composer_lightning.tasks import get_task  # noqa: E402
from composer_lightning.tasks.openenv import OpenEnvTask  # noqa: E402

ECHO_TOOL = Tool(
    name="echo_message",
    description="Echo a message back.",
    input_schema={
        "type": "object",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
    },
)


class EchoSessions(ResourceSessionFactory):
    """Sessions of the scaffolded echo environment's server at `base_url`."""

    def __init__(self, base_url: str, package_dir: str) -> None:
        if package_dir not in sys.path:
            sys.path.insert(0, package_dir)
        self.base_url = base_url
        self.client_cls = importlib.import_module("echo_env.client").EchoEnv
        self.action_cls = importlib.import_module("echo_env.models").EchoAction

    def create(self, task=None, seed=None, episode_id=None):
        prompt = (task or {}).get("prompt", "Echo something.")
        return StepEnvSessionAdapter(
            self.client_cls(base_url=self.base_url),
            task=task,
            seed=seed,
            episode_id=episode_id,
            tool_specs=[ECHO_TOOL],
            action_builder=lambda name, args: self.action_cls(**args),
            initial_messages_builder=lambda result, task: [
                {"role": "system", "content": result.observation.echoed_message},
                {"role": "user", "content": prompt},
            ],
        )


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    """(base_url, package_dir) of the scaffolded echo environment served on loopback."""
    import uvicorn
    from openenv.cli.commands.init import init

    out = tmp_path_factory.mktemp("openenv")
    init("echo_env", output_dir=str(out))
    sys.path.insert(0, str(out))
    app = importlib.import_module("echo_env.server.app").app
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(2400):  # up to 2 min on a loaded machine; leaves as soon as it is up
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "echo server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", str(out)
    server.should_exit = True
    thread.join(timeout=10)
    sys.path.remove(str(out))


@pytest.fixture
def closing():
    """Closes the test's sessions and episodes, so that a failed test (which leaves one open)
    does not hold the server's single session slot for the next."""
    opened = []
    yield opened.append
    for thing in opened:
        thing.close()


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def harness_run(factory, turns, task):
    """OpenEnv's own loop over scripted (content, [(name, args)]) turns: (rollout, reward)."""
    script = iter(turns)

    def model_step(messages, tools, sampling):
        content, calls = next(script)
        tool_calls = [OEToolCall(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)]
        return ModelStepResult(response=LLMResponse(content=content, tool_calls=tool_calls))

    session = factory.create(task=task)
    try:
        rollout = MCPHarnessAdapter().run_white_box(model_step, session, HarnessRunLimits())
        return rollout, _resolve_env_reward(rollout, session.verify(rollout.messages))
    finally:
        session.close()


def test_episode_matches_openenv_loop(echo_server, closing):
    """hello (5 chars) echoes with reward 0.5; a malformed call and an unknown tool are tool
    errors that leave the episode running; the final answer ends it with the last reward."""
    factory = EchoSessions(*echo_server)
    task = {"prompt": "Echo 'hello', then stop."}
    env = OpenEnvEpisode(factory)
    closing(env)
    assert isinstance(env, Environment)

    opening = env.reset({"openenv_task": task, "seed": 3})
    assert opening == [
        {"role": "system", "content": "Echo Env environment ready!"},
        {"role": "user", "content": task["prompt"]},
    ]
    assert env.tools == [
        {
            "type": "function",
            "function": {
                "name": "echo_message",
                "description": "Echo a message back.",
                "parameters": ECHO_TOOL.input_schema,
            },
        }
    ]

    first = env.step({"role": "assistant", "content": call("echo_message", {"message": "hello"})})
    assert not first.done and first.reward is None and first.tool_error is None
    assert len(first.messages) == 1 and first.messages[0]["role"] == "tool"
    assert "echoed_message='hello'" in first.messages[0]["content"]

    bad = env.step({"role": "assistant", "content": '<tool_call>{"name": "echo_mess</tool_call>'})
    assert not bad.done and bad.tool_error.startswith("malformed tool call: JSONDecodeError")
    assert bad.messages == [{"role": "tool", "tool_call_id": "call_1_0", "content": bad.tool_error}]

    unknown = env.step({"role": "assistant", "content": call("shout", {"message": "hi"})})
    assert not unknown.done and unknown.tool_error == "KeyError: 'Unknown tool: shout'"
    missing = env.step({"role": "assistant", "content": call("echo_message", {})})
    assert not missing.done and "ValidationError" in missing.tool_error
    assert "message" in missing.tool_error

    final = env.step({"role": "assistant", "content": "I echoed hello."})
    assert final.done and final.messages == [] and final.tool_error is None
    assert final.reward == pytest.approx(0.5)

    # The valid turns through OpenEnv's own loop: the same tool message and reward.
    rollout, reward = harness_run(
        factory, [("", [("echo_message", {"message": "hello"})]), ("I echoed hello.", [])], task
    )
    assert reward == pytest.approx(final.reward)
    assert rollout.done
    ours = [m for m in env.transcript if m["role"] == "tool"][0]
    theirs = [m for m in rollout.messages if m["role"] == "tool"][0]
    assert ours["content"] == theirs["content"] and ours["name"] == theirs["name"]
    assert env.session is None  # closed with the episode
    # OpenEnv's own session raises the error the adapter reported; its loop would stop on it.
    session = factory.create(task=task)
    closing(session)
    with pytest.raises(KeyError, match="Unknown tool: shout"):
        session.call_tool("shout", {"message": "hi"})
    session.close()
    with pytest.raises(RuntimeError, match="reset"):
        env.step({"role": "assistant", "content": "more"})


def test_max_turns_ends_with_the_environments_reward(echo_server, closing):
    """The echo environment never ends an episode: the turn limit does, with the reward of
    the last echo (3 chars: 0.3), as OpenEnv's loop does at the same limit."""
    factory = EchoSessions(*echo_server)
    env = OpenEnvEpisode(factory, max_turns=2)
    closing(env)
    env.reset({"openenv_task": None})
    assert not env.step(
        {"role": "assistant", "content": call("echo_message", {"message": "abcd"})}
    ).done
    last = env.step({"role": "assistant", "content": call("echo_message", {"message": "abc"})})
    assert last.done and last.reward == pytest.approx(0.3) and len(last.messages) == 1

    script = iter([[("echo_message", {"message": "abcd"})], [("echo_message", {"message": "abc"})]])

    def model_step(messages, tools, sampling):
        calls = [OEToolCall(f"call_{i}", n, a) for i, (n, a) in enumerate(next(script))]
        return ModelStepResult(response=LLMResponse(content="", tool_calls=calls))

    session = factory.create()
    closing(session)
    rollout = MCPHarnessAdapter().run_white_box(model_step, session, HarnessRunLimits(max_turns=2))
    assert _resolve_env_reward(rollout, session.verify(rollout.messages)) == pytest.approx(0.3)
    session.close()


def test_task_draws_episodes_by_dotted_path(echo_server, closing):
    """`get_task` (what `RolloutDataModule(task=..., task_args=...)` calls) builds the task;
    its problems carry the drawn OpenEnv task and a seed, and its environment plays them."""
    base_url, package_dir = echo_server
    task = get_task(
        "composer_lightning.tasks.openenv.OpenEnvTask",
        factory=f"{__name__}:EchoSessions",
        factory_args={"base_url": base_url, "package_dir": package_dir},
        tasks=[{"prompt": "Echo 'a'."}, {"prompt": "Echo 'bb'."}],
        max_turns=3,
    )
    assert isinstance(task, OpenEnvTask)
    problems = task.samples(4, seed=0)
    assert problems == task.samples(4, seed=0)
    assert {p["openenv_task"]["prompt"] for p in problems} <= {"Echo 'a'.", "Echo 'bb'."}
    assert all(p["task"] == "composer_lightning.tasks.openenv.OpenEnvTask" for p in problems)
    env = task.environment(problems[0])
    closing(env)
    assert env.reset(problems[0])[1]["content"] == problems[0]["openenv_task"]["prompt"]
    env.step({"role": "assistant", "content": call("echo_message", {"message": "bb"})})
    assert env.step({"role": "assistant", "content": "done"}).reward == pytest.approx(0.2)
    with pytest.raises(NotImplementedError, match="environment's own"):
        task.verify(problems[0], "done")


def test_tool_calls_field_is_read_before_text():
    """OpenAI-style `tool_calls` (arguments as a JSON string or an object) win over text."""
    msg = {
        "role": "assistant",
        "content": call("ignored", {}),
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}},
            {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
        ],
    }
    a, b, c = parse_tool_calls(msg)
    assert (a.id, a.name, a.arguments, a.error) == ("a", "f", {"x": 1}, None)
    assert (b.name, b.arguments) == ("g", {"y": 2})
    assert c.name is None and c.error.startswith("malformed tool call: TypeError")
    assert parse_tool_calls({"role": "assistant", "content": "no calls"}) == []

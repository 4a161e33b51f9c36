"""serve driven by the OpenAI Agents SDK (`openai-agents`), as a user points an agent at any
OpenAI-compatible endpoint: the SDK's own function-calling loop against the tiny tool policy."""

from __future__ import annotations

import pytest

agents = pytest.importorskip("agents")

from openai import AsyncOpenAI  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from composer_lightning.engines import HFEngine  # noqa: E402
from composer_lightning.models.tiny import tiny_tool_policy_path  # noqa: E402
from composer_lightning.serve import (  # noqa: E402
    BackgroundServer,
    EngineBackend,
    TurnStore,
    make_app,
)


def test_an_agents_sdk_agent_calls_its_tool_through_serve_and_the_turn_gets_the_result(tmp_path):
    """`Agent(tools=[add])` on `OpenAIChatCompletionsModel` with serve's URL: the policy's call
    reaches the SDK as a tool call, the SDK runs the function and sends the result back, the
    policy answers; the calling turn is recorded with the tool's result as its next state."""
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number.
            b: the second number.
        """
        calls.append((a, b))
        return a + b

    path = tiny_tool_policy_path()
    backend = EngineBackend(HFEngine(model_path=path, seed=0), AutoTokenizer.from_pretrained(path))
    store = TurnStore(tmp_path / "turns.db")
    with BackgroundServer(make_app(backend, store, model_name="tiny")) as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
        settings = agents.ModelSettings(
            temperature=0, max_tokens=32, extra_body={"session_id": "sdk"}
        )
        model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
        agent = agents.Agent(name="calc", model=model, tools=[add], model_settings=settings)
        result = agents.Runner.run_sync(agent, "What is 12 + 30?", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    ((a, b),) = calls
    assert isinstance(result.final_output, str) and result.final_output
    called, answered = store.session_turns("sdk")
    assert called.response_text.startswith('<tool_call>{"name": "add"')
    assert called.state == "ready" and called.next_state[0]["role"] == "tool"
    assert called.next_state[0]["content"] == str(a + b)
    assert answered.response_text == result.final_output

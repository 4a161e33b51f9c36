"""serve driven as an agent harness drives any OpenAI model: a function-calling loop with the
`openai` client against the tiny tool policy (tool calls out as `tool_calls`, back in as history)."""

from __future__ import annotations

import json

import openai
from transformers import AutoTokenizer

from composer_lightning.engines import HFEngine
from composer_lightning.serve import BackgroundServer, EngineBackend, TurnStore, make_app

MODEL = "tiny"


def test_a_function_calling_loop_through_the_openai_client(tmp_path):
    """The tiny tool policy behind serve, driven as an agent harness drives any OpenAI model:
    `tools=` offered, its reply comes back as `tool_calls` (finish_reason "tool_calls", in the
    stream too), the harness runs the tool and sends the assistant message back in OpenAI's
    `tool_calls` form with the tool's result; that turn gets the result as its next state, and
    the template renders the call into the next prompt."""
    from transformers.utils import get_json_schema

    from composer_lightning.models.tiny import tiny_tool_policy_path
    from composer_lightning.tasks.tool_calc import add

    path = tiny_tool_policy_path()
    tok = AutoTokenizer.from_pretrained(path)
    backend = EngineBackend(HFEngine(model_path=path, seed=0), tok)
    store = TurnStore(tmp_path / "turns.db")
    tools = [get_json_schema(add)]  # {"type": "function", "function": {...}}
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    with BackgroundServer(make_app(backend, store, model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
        ask = dict(model=MODEL, tools=tools, max_tokens=32, temperature=0, extra_body={"session_id": "agent"})  # fmt: skip
        first = client.chat.completions.create(messages=messages, **ask)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.type == "function" and call.function.name == "add" and call.id
        result = add(**arguments)
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": str(result)},
        ]
        second = client.chat.completions.create(messages=messages, **ask)
        stream = client.chat.completions.create(messages=messages[:1], stream=True, **{**ask, "extra_body": {"session_id": "streamed"}})  # fmt: skip
        chunks = list(stream)
    assert second.choices[0].message.content is not None
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert streamed[-1].finish_reason == "tool_calls"
    (delta,) = [d.delta.tool_calls[0] for d in streamed if d.delta.tool_calls]
    assert (delta.index, delta.function.name) == (0, "add")
    assert delta.id != call.id  # each call its own id, as OpenAI's
    turn0, turn1 = store.session_turns("agent")
    assert turn0.next_state == [{"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    assert "<tool_call>" in turn0.response_text  # recorded as the model wrote it
    rendered = tok.decode(turn1.prompt_ids)
    assert (
        f'<tool_call>{{"name": "add", "arguments": {json.dumps(arguments)}}}</tool_call>'
        in rendered
    )


def test_the_agent_loop_example_runs_on_the_tiny_tool_policy(capsys):
    """`examples/tool_sft/agent_loop.py` (SmolLM2 before and after SFT: docs/benchmarks/smollm2_tools.md)
    on the tiny tool policy, which calls `add`: its figures count what happened."""
    from composer_lightning.models.tiny import tiny_tool_policy_path
    from examples.tool_sft.agent_loop import held_out, run

    problems = held_out(2, seed=1)
    figures = run(tiny_tool_policy_path(), problems, turns=3, max_tokens=48)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all('"tool_calls"' in line for line in lines), lines
    assert figures["first_reply_calls"] == 1.0
    assert 0.0 <= figures["answered_right"] <= 1.0

"""chat/tool_calls.py: one parser for serve, PythonToolEnv and the OpenEnv adapter."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from composer_lightning.chat import render_ids
from composer_lightning.chat.tool_calls import (
    FORMATS,
    ToolCall,
    calls_as_text,
    find_tool_calls,
    for_template,
    format_of_template,
    parse_tool_calls,
    resolve_format,
    same_reply,
    split_reply,
    with_calls_as_text,
)
from composer_lightning.models.tiny import tiny_tool_policy_path
from composer_lightning.rollout.episodes import run_episodes

ADD = {"name": "add", "arguments": {"a": 12, "b": 30}}


def test_every_format_gives_the_same_call() -> None:
    """Hermes / Qwen blocks, Mistral's [TOOL_CALLS] list, a Llama-style JSON reply (with
    "parameters") and OpenAI's tool_calls field (arguments as a JSON string) are the same call;
    the text outside the calls is the content."""
    texts = {
        "hermes": f"Let me add. <tool_call>{json.dumps(ADD)}</tool_call>",
        "mistral": f"Let me add. [TOOL_CALLS] {json.dumps([ADD])}",
        "llama": json.dumps({"name": "add", "parameters": {"a": 12, "b": 30}}),
    }
    for fmt, text in texts.items():
        content, (call,) = split_reply(text, turn=2)
        assert (call.name, call.arguments, call.error, call.id) == (
            "add",
            ADD["arguments"],
            None,
            "call_2_0",
        ), fmt
        assert content == ("" if fmt == "llama" else "Let me add.")
    openai_form = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps(ADD["arguments"])}}],
    }  # fmt: skip
    assert parse_tool_calls(openai_form) == [ToolCall("c1", "add", ADD["arguments"])]
    assert parse_tool_calls({"role": "assistant", "content": texts["hermes"]})[0].name == "add"


def test_malformed_calls_are_calls_with_an_error_and_plain_text_is_none() -> None:
    (bad,) = parse_tool_calls({"role": "assistant", "content": "<tool_call>{not json</tool_call>"})
    assert bad.name is None and bad.error.startswith("malformed tool call: JSONDecodeError")
    (noargs,) = split_reply('<tool_call>{"name": 3, "arguments": []}</tool_call>')[1]
    assert "'name' must be a string" in noargs.error
    for text in ("The answer is 42.", '{"answer": 42}', "<tool_call>{...", "[1, 2]", "{"):
        assert find_tool_calls(text) == (text, []), text  # not a call (cut, or other JSON)
    assert [c.name for c in split_reply("<tool_call>" + json.dumps(ADD) + "</tool_call>" * 1 + "<tool_call>" + json.dumps({**ADD, "name": "mul"}) + "</tool_call>")[1]] == ["add", "mul"]  # fmt: skip


def test_a_reply_is_the_same_however_the_client_reserialises_its_calls() -> None:
    """serve matches a turn's reply in the next request's history: the model's raw text
    against the client's OpenAI form (arguments re-serialised, other key order)."""
    raw = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    sent = {
        "role": "assistant",
        "content": "Sure.",
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"b":30,"a":12}'}}],
    }  # fmt: skip
    assert same_reply(sent, raw)
    assert same_reply({"role": "assistant", "content": raw}, raw)
    other = json.loads(json.dumps(sent))
    other["tool_calls"][0]["function"]["arguments"] = '{"a": 12, "b": 31}'
    assert not same_reply(other, raw)
    assert not same_reply({"role": "assistant", "content": "Sure."}, raw)


def test_history_tool_calls_render_through_a_template_without_them_as_hermes_text() -> None:
    """The tiny tool policy's template renders only `content`: an OpenAI tool-call message is
    written as the Hermes block the model itself writes, so the call is in the prompt."""
    tok = AutoTokenizer.from_pretrained(tiny_tool_policy_path())
    history = [
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}}]},
        {"role": "tool", "content": "42"},
    ]  # fmt: skip
    rendered = for_template(history, tok)
    assert rendered == with_calls_as_text(history)
    assert rendered[1] == {
        "role": "assistant",
        "content": f"<tool_call>{json.dumps(ADD)}</tool_call>",
    }
    text = tok.decode(render_ids(tok, rendered, add_generation_prompt=True))
    assert '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>' in text

    class Renders:  # a template that renders tool_calls (Qwen's, Hermes'): kept, args as objects
        chat_template = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}"

    (kept,) = [m for m in for_template(history, Renders()) if m.get("tool_calls")]
    assert kept["tool_calls"][0]["function"]["arguments"] == ADD["arguments"]


def test_tools_go_into_the_system_message_where_the_template_does_not_render_them() -> None:
    """SmolLM2's template ignores `tools`: every render describes them in the system message
    (after its own text, or as a new first message), so an episode's model sees its tools; a
    template that renders them gets them as they are; `for_template` leaves that to rendering."""
    from composer_lightning.chat.tool_calls import TOOLS_SYSTEM_TEXT
    from composer_lightning.models.tiny import tiny_policy_path

    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "function", "function": {"name": "add", "parameters": params}}
    plain = AutoTokenizer.from_pretrained(tiny_policy_path())  # renders no tools
    chat = [{"role": "user", "content": "hi"}]
    system = {"role": "system", "content": TOOLS_SYSTEM_TEXT.format(tools=json.dumps(spec))}
    assert render_ids(plain, chat, True, tools=[spec]) == render_ids(plain, [system, *chat], True)
    own = [{"role": "system", "content": "Be brief."}, *chat]
    joined = {"role": "system", "content": f"Be brief.\n\n{system['content']}"}
    assert render_ids(plain, own, True, tools=[spec]) == render_ids(plain, [joined, *chat], True)
    assert for_template(chat, plain) == chat
    tools_tok = AutoTokenizer.from_pretrained(tiny_tool_policy_path())  # renders them itself
    rendered = tools_tok.decode(render_ids(tools_tok, chat, True, tools=[spec]))
    assert "add(" in rendered and "You may call" not in rendered


def test_a_format_by_name_reads_only_its_own_calls_and_writes_them_back_alike() -> None:
    texts = {
        "hermes": f"<tool_call>{json.dumps(ADD)}</tool_call>",
        "mistral": f"[TOOL_CALLS]{json.dumps([ADD])}",
        "llama3_json": json.dumps({"name": "add", "parameters": ADD["arguments"]}),
    }
    for fmt in ("hermes", "mistral", "llama3_json"):
        for other, text in texts.items():
            calls = split_reply(text, fmt=fmt)[1]
            assert [c.name for c in calls] == (["add"] if other == fmt else []), (fmt, other)
        two = [ToolCall("a", "add", {"a": 1}), ToolCall("b", "mul", {"x": 2})]
        for calls in (two, two[:1]):
            written = calls_as_text(calls, fmt)
            back = split_reply(written, fmt=fmt)[1]
            assert [(c.name, c.arguments) for c in back] == [(c.name, c.arguments) for c in calls]
    assert FORMATS[0] == "auto" and all(split_reply(t)[1] for t in texts.values())


def test_the_template_names_its_format() -> None:
    class Tok:
        def __init__(self, template):
            self.chat_template = template

    qwen = "{%- for tool in tools %}...<tool_call>\n{{ tool_call | tojson }}\n</tool_call>"
    mistral = "{%- if message.tool_calls %}[TOOL_CALLS][{%- for tool in message.tool_calls %}"
    llama = "{%- if message.role == 'ipython' %}<|python_tag|>{{ message.content }}"
    chatml = "{% for message in messages %}<|im_start|>{{ message.role }}..."
    got = [format_of_template(Tok(t)) for t in (qwen, mistral, llama, chatml, None)]
    assert got == ["hermes", "mistral", "llama3_json", "auto", "auto"]
    assert resolve_format("template", Tok(qwen)) == "hermes"
    assert resolve_format("mistral", Tok(qwen)) == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call format 'json'"):
        resolve_format("json")


def test_the_episode_loop_gives_a_template_format_environment_its_templates_format() -> None:
    """An environment with tool_call_format="template" reads the calls in the format of the
    tokenizer's template (here one that writes Hermes blocks): a Llama-style JSON reply is then
    its final answer, not a call."""
    from composer_lightning.engines.base import Completion, SamplingConfig
    from composer_lightning.envs import PythonToolEnv

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: a.
            b: b.
        """
        return a + b

    tokenizer = AutoTokenizer.from_pretrained(tiny_tool_policy_path())
    tokenizer.chat_template += "{# calls are written <tool_call>{...}</tool_call> #}"
    reply = json.dumps({"name": "add", "parameters": {"a": 1, "b": 2}})
    ids = tokenizer.encode(reply, add_special_tokens=False)

    def generate(prompts, n, sampling):
        return [[Completion(ids, [0.0] * len(ids), "stop", reply)] * n for _ in prompts]

    envs = []

    def environment(problem):
        envs.append(PythonToolEnv([add], tool_call_format="template"))
        return envs[-1]

    problem = {"messages": [{"role": "user", "content": "1 + 2?"}]}
    (episodes,) = run_episodes(
        generate, [problem], [[1]], environment, tokenizer, SamplingConfig(max_tokens=8), 1, 3
    )
    assert envs[0].tool_call_format == format_of_template(tokenizer) == "hermes"
    assert len(episodes[0].turns) == 1 and episodes[0].status == "done"

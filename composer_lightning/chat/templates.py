"""Chat templates on token ids: a problem's chat, its prompt ids, and rendering with tools.

Without a chat template (a base model) prompts are plain text, as in TRL's standard format: a
`{"prompt": text}` problem (or a task's chat of one user message) is tokenised as it is
(`tokenizer(text)`, special tokens as the tokenizer adds them). Any other chat (a
conversational `{"prompt": [...]}` row, a system message, a tool trace) needs a template: one
ValueError naming the tokenizer, as TRL's `apply_chat_template` refuses it.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from composer_lightning.chat.literal import render_literal

Message = dict[str, Any]

#: What separates a base model's prompt text from the hint, and the hint from the response.
BASE_HINT_SEPARATOR = "\n\n"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer has a chat template (a base model's tokenizer usually has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def no_template(tokenizer: Any, what: str) -> ValueError:
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    return ValueError(
        f"tokenizer {name!r} has no chat template, so {what} cannot be rendered: give plain-text "
        'prompts ({"prompt": "..."}) or a tokenizer with a chat template'
    )


def render_ids(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of `messages` (and the `tools` specs shown to the model) under the tokenizer's
    chat template (no extra special tokens), with the template variables of the tokenizer's
    `chat_template_kwargs` attribute when it has one (TRL's `chat_template_kwargs`, e.g.
    `enable_thinking: false`; `RolloutDataModule` sets it from `data.chat_template_kwargs`, so
    prompts, hinted contexts and episodes of a run all render alike). A template that does not
    render `tools` (SmolLM2's) gets them described in the system message
    (`chat.tool_calls.with_tools_in_system`), so the model is always shown its tools.

    Every string of `messages` and `tools` (contents, names, tool specs, call arguments) is
    literal text: the special tokens in the ids are the template's own (`chat/literal.py`).

    Raises:
        ValueError: the tokenizer has no chat template (one line naming it), or the template
            renders a string holding a special token's string otherwise than other text.
    """
    if not has_chat_template(tokenizer):
        raise no_template(tokenizer, "a chat")
    extra = dict(getattr(tokenizer, "chat_template_kwargs", None) or {})
    shown = None  # the tools the template renders itself
    if tools:
        from composer_lightning.chat.tool_calls import template_renders_tools, with_tools_in_system

        if template_renders_tools(tokenizer):
            shown = tools
        else:  # the template would drop them silently: the system message describes them
            messages = with_tools_in_system(messages, tools)

    def render(chat: list[Message], specs: list[dict[str, Any]] | None) -> str:
        given = extra if specs is None else {**extra, "tools": specs}
        return tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt, **given
        )

    return render_literal(tokenizer, render, messages, shown)


def template_delta(
    tokenizer: Any,
    chat: list[Message],
    new: list[Message],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The ids that `new` messages add after `chat` (then the generation prompt).

    Raises:
        ValueError: the template is not prefix-stable there (it re-renders `chat` differently
            once `new` follows), so the delta does not exist.
    """
    before = render_ids(tokenizer, chat, False, tools=tools)
    after = render_ids(tokenizer, [*chat, *new], add_generation_prompt, tools=tools)
    if after[: len(before)] != before:
        raise ValueError(
            f"the chat template is not prefix-stable: appending {[m['role'] for m in new]} "
            f"after message {len(chat) - 1} re-renders the earlier chat, so turns cannot be "
            "appended as token ids; use a template that renders each message independently"
        )
    return after[len(before) :]


def _is_chat(value: Any) -> TypeGuard[list[Message]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def problem_messages(problem: dict[str, Any]) -> list[Message]:
    """A problem's chat: `"messages"`, a conversational `"prompt"` (TRL's `{"prompt": [{"role",
    "content"}, ...]}`), or a `"prompt"` string as a single user message."""
    if problem.get("messages"):
        return list(problem["messages"])
    prompt = problem.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if _is_chat(prompt):
        return list(prompt)
    raise ValueError(
        "a problem needs 'messages' (a chat) or 'prompt' (a string, or a chat: a list of "
        "{role, content})"
    )


def plain_prompt(problem: dict[str, Any]) -> str | None:
    """A problem's prompt as plain text, for a tokenizer without a chat template: a `"prompt"`
    string, or a `"messages"` chat of one user message (how the built-in tasks write a plain
    prompt); None for any other chat, a conversational `"prompt"` row included (TRL refuses
    those without a template too)."""
    messages = problem.get("messages")
    if messages:
        only = messages[0] if len(messages) == 1 else {}
        return only.get("content") if only.get("role") == "user" else None
    prompt = problem.get("prompt")
    return prompt if isinstance(prompt, str) else None


def tokenize_prompt(tokenizer: Any, problem: dict[str, Any]) -> list[int]:
    """The prompt ids the engine receives: the chat template with the generation prompt, or,
    without a template, the plain prompt tokenised as it is (TRL's standard format)."""
    messages = problem_messages(problem)
    if has_chat_template(tokenizer):
        return render_ids(tokenizer, messages, add_generation_prompt=True)
    text = plain_prompt(problem)
    if text is None:
        raise no_template(tokenizer, "a conversational prompt (a chat)")
    return list(tokenizer(text)["input_ids"])

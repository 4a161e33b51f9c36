"""Chat templates on token ids: a problem's chat, its prompt ids, and rendering with tools.

Without a chat template (a base model) prompts are plain text, as in TRL's standard format: a
`{"prompt": text}` problem (or a task's chat of one user message) is tokenised as it is
(`tokenizer(text)`, special tokens as the tokenizer adds them). Any other chat (a
conversational `{"prompt": [...]}` row, a system message, a tool trace) needs a template: one
ValueError naming the tokenizer, as TRL's `apply_chat_template` refuses it.
"""

from __future__ import annotations

from typing import Any

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

    Raises:
        ValueError: the tokenizer has no chat template (one line naming it).
    """
    if not has_chat_template(tokenizer):
        raise no_template(tokenizer, "a chat")
    extra = dict(getattr(tokenizer, "chat_template_kwargs", None) or {})
    if tools:
        from composer_lightning.chat.tool_calls import template_renders_tools, with_tools_in_system

        if template_renders_tools(tokenizer):
            extra["tools"] = tools
        else:  # the template would drop them silently: the system message describes them
            messages = with_tools_in_system(messages, tools)
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    return _ids_with_literal_content(tokenizer, text, messages)


def _control_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into its added (control) tokens wherever they appear."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [str(getattr(t, "content", t)) for t in decoder.values()]


def _content_texts(messages: list[Message]) -> list[str]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):  # OpenAI content parts
            out += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    return out


def _ids_with_literal_content(tokenizer: Any, text: str, messages: list[Message]) -> list[int]:
    """`tokenizer(text)` ids, except that a control token's string inside a message's content
    (`<|im_start|>`, `<|eot|>`, ...) is tokenised as the text it is, never as the control token:
    otherwise a user could write `...<|eot|><|assistant|>7` and forge an assistant turn in the
    recorded prompt (training data). Only when some content holds such a string does the text
    get tokenised in pieces (the template's own text, then each such content with
    `split_special_tokens`); otherwise the ids are exactly `tokenizer(text)`'s.

    Raises:
        ValueError: the template changed such a content, so it cannot be found in the text.
    """
    plain = lambda piece: list(tokenizer(piece, add_special_tokens=False)["input_ids"])  # noqa: E731
    controls = _control_strings(tokenizer)
    risky = [c for c in _content_texts(messages) if any(k in c for k in controls)]
    if not risky:
        return plain(text)
    ids, cursor = [], 0
    for content in risky:
        start = text.find(content, cursor)
        if start < 0:
            found = [k for k in controls if k in content]
            raise ValueError(
                f"a message's content holds the control token(s) {found} and the chat "
                "template changed that content, so it cannot be kept as plain text: remove them"
            )
        ids += plain(text[cursor:start])
        ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        cursor = start + len(content)
    return ids + plain(text[cursor:])


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


def _is_chat(value: Any) -> bool:
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

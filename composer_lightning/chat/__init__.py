"""Chat templates on token ids, and where the hint goes.

Owns: rendering a problem's chat (and the tools shown to the model) to the token ids the engine
receives (`templates.py`), every client string in it plain text, never a control token
(`literal.py`), and the teacher's hinted context beside the student's, aligned token
by token (`hints.py`); tool calls in a model's text and in OpenAI's form, the one parser serve
and the tool environments share (`tool_calls.py`). May import: nothing of the package (a
tokenizer and messages in, token ids out).
"""

from composer_lightning.chat.hints import (
    HINT_ROLES,
    HINT_TEMPLATE,
    TeacherContext,
    TraceSample,
    check_hint_role,
    check_hint_template,
    fill_hint,
    first_error_turn,
    hint_message,
    multi_turn_sample,
    single_turn_teacher,
    with_hint,
)
from composer_lightning.chat.templates import (
    BASE_HINT_SEPARATOR,
    Message,
    has_chat_template,
    plain_prompt,
    problem_messages,
    render_ids,
    template_delta,
    tokenize_prompt,
)

__all__ = [
    "HINT_ROLES",
    "HINT_TEMPLATE",
    "check_hint_role",
    "check_hint_template",
    "fill_hint",
    "BASE_HINT_SEPARATOR",
    "Message",
    "TeacherContext",
    "TraceSample",
    "first_error_turn",
    "has_chat_template",
    "hint_message",
    "multi_turn_sample",
    "plain_prompt",
    "problem_messages",
    "render_ids",
    "single_turn_teacher",
    "template_delta",
    "with_hint",
    "tokenize_prompt",
]

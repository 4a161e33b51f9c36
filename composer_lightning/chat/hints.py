"""Where the hint goes: the teacher's context beside the student's, aligned token by token.

Single-turn, the hint follows the prompt as an extra `hint_role` message, then the *same*
response ids; multi-turn tool traces, right after the first erroneous turn (a turn whose
structured `tool_error` field is not None — never string matching) and before the next
assistant turn (docs/design.md, "Where the hint goes"). Teacher and student are aligned by `teacher_positions` (the teacher
index of each student response token), built by rendering the chat turn by turn: that needs a
*prefix-stable* template (rendering the first k turns gives a token prefix of rendering k + 1);
a template that is not raises ValueError rather than misalign tokens. Without a chat template
(a base model, whose prompt is text it continues) an `inline` hint goes before the prompt
text, `hint + BASE_HINT_SEPARATOR + prompt`, so the prompt still ends where the reply
continues it; a `user` or `system` hint follows it, `prompt + BASE_HINT_SEPARATOR + hint +
BASE_HINT_SEPARATOR`. Then the same response ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer_lightning.chat.templates import (
    BASE_HINT_SEPARATOR,
    Message,
    has_chat_template,
    no_template,
    render_ids,
)


@dataclass
class TeacherContext:
    """A hinted single-turn context.

    Attributes:
        teacher_ids: hinted prompt ⊕ the student's response ids.
        response_start: teacher index of the first response token.
    """

    teacher_ids: list[int]
    response_start: int

    def positions(self, prompt_len: int, seq_len: int) -> list[int]:
        """`teacher_positions` for a student sequence of `seq_len` tokens whose response starts
        at `prompt_len` (−1 on prompt tokens)."""
        n_response = len(self.teacher_ids) - self.response_start
        if seq_len - prompt_len != n_response:
            raise ValueError(
                f"student has {seq_len - prompt_len} response tokens, teacher {n_response}"
            )
        return [-1] * prompt_len + list(range(self.response_start, len(self.teacher_ids)))


#: Where a hint goes: a message of its own after the context (`user`, `system`), or appended to
#: the context's last message (`inline`: the question itself, or a tool's error, says more).
HINT_ROLES = ("user", "system", "inline")


def check_hint_role(hint_role: str) -> None:
    """One error naming a `hint_role` that is not one of `HINT_ROLES`."""
    if hint_role not in HINT_ROLES:
        raise ValueError(f"hint_role must be one of {list(HINT_ROLES)}, got {hint_role!r}")


#: The hint's text as the teacher reads it: the hint itself. SDPO's reference ends every teacher
#: context with an instruction (lasgroup/SDPO's reprompt, "…\n\nCorrectly solve the original
#: question."); `"{hint}\n\nCorrectly solve the original question."` does that here.
HINT_TEMPLATE = "{hint}"


def check_hint_template(template: str) -> None:
    """One error naming a `hint_template` that is not text holding `{hint}` once."""
    if not isinstance(template, str) or template.count("{hint}") != 1:
        raise ValueError(
            f"hint_template must be text holding {{hint}} once (where the hint goes), got "
            f"{template!r}"
        )


def fill_hint(template: str, value: str | list[str] | None) -> str | list[str] | None:
    """A hint value (one hint, candidates, or None) with each hint put in `template` where it
    says `{hint}` (nothing else in it is read: braces of its own stay as they are)."""
    if value is None or template == HINT_TEMPLATE:
        return value
    if isinstance(value, str):
        return template.replace("{hint}", value)
    return [template.replace("{hint}", v) for v in value]


def hint_message(hint: str, hint_role: str = "user") -> Message:
    """The message that carries a hint."""
    if hint_role not in ("user", "system"):
        raise ValueError(f"hint_role must be 'user' or 'system', got {hint_role!r}")
    return {"role": hint_role, "content": hint}


def with_hint(messages: list[Message], after: int, hint: str, hint_role: str) -> list[Message]:
    """`messages` with the hint placed after `messages[after]`: a message of its own there, or,
    `inline`, appended to that message's content (`content + "\n\n" + hint`)."""
    check_hint_role(hint_role)
    if hint_role == "inline":
        message = messages[after]
        placed = dict(message, content=f"{message['content']}{BASE_HINT_SEPARATOR}{hint}")
        return [*messages[:after], placed, *messages[after + 1 :]]
    return [*messages[: after + 1], hint_message(hint, hint_role), *messages[after + 1 :]]


def single_turn_teacher(
    tokenizer: Any,
    messages: list[Message],
    response_ids: list[int],
    hint: str,
    hint_role: str = "user",
    tools: list[dict[str, Any]] | None = None,
) -> TeacherContext:
    """Teacher context: `messages` + hint message, generation prompt, then the same response
    (`tools`: the tool specs the student was shown). For turn t of an episode, `messages` is
    turn t's context: the hint is spliced right before the turn it is about.
    Without a chat template (a base model, whose prompt is one plain-text user message):
    `inline`, `hint + BASE_HINT_SEPARATOR + prompt`, so the reply still continues the prompt's
    own last words ("7 + 5 =" then " 12"; after a hint appended to it, Gemma 3 270M went on
    with the hint's text instead: told the answer, its greedy reply was right on 15 of 24 sums
    with the hint after the prompt, 21 of 24 with it before, `bench/hint_placement.py`);
    `user` or `system`, `prompt + BASE_HINT_SEPARATOR + hint + BASE_HINT_SEPARATOR`, a message
    of its own after the prompt. Then the same response.

    Args:
        tokenizer: the policy's tokenizer.
        messages: the student's prompt chat.
        response_ids: the sampled response token ids (copied unchanged).
        hint: hint text.
        hint_role: where the hint goes (`HINT_ROLES`): a "user" or "system" message after
            `messages`, or "inline", appended to their last message.
    """
    if has_chat_template(tokenizer):
        prompt = render_ids(
            tokenizer,
            with_hint(messages, len(messages) - 1, hint, hint_role),
            add_generation_prompt=True,
            tools=tools,
        )
    elif len(messages) == 1 and messages[0]["role"] == "user":
        check_hint_role(hint_role)
        text, sep = messages[0]["content"], BASE_HINT_SEPARATOR
        text = f"{hint}{sep}{text}" if hint_role == "inline" else f"{text}{sep}{hint}{sep}"
        prompt = list(tokenizer(text)["input_ids"])
    else:
        raise no_template(tokenizer, "a conversational prompt (a chat)")
    return TeacherContext(teacher_ids=prompt + list(response_ids), response_start=len(prompt))


@dataclass
class TraceSample:
    """A tokenised multi-turn trace, with its hinted teacher when there is one.

    Attributes:
        student_ids: the chat template over the whole trace.
        response_mask: per student token, True on assistant content (incl. end of turn).
        teacher_ids: the trace with the hint after the first error turn; None without teacher.
        teacher_positions: per student token, the teacher index of the same token on response
            tokens, −1 elsewhere (all −1 without teacher).
        sdpo_mask: response tokens after the hint (the recovery); all False without teacher.
        error_turn: index of the first message with a `tool_error`, or None.
        candidates: `(teacher_ids, teacher_positions)` of each candidate hint, shortest hint
            first (top-k OPD's hint selection); empty without candidates.
    """

    student_ids: list[int]
    response_mask: list[bool]
    teacher_ids: list[int] | None
    teacher_positions: list[int]
    sdpo_mask: list[bool]
    error_turn: int | None
    candidates: list[tuple[list[int], list[int]]] = field(default_factory=list)

    @property
    def has_teacher(self) -> bool:
        """Whether a hinted teacher context exists."""
        return self.teacher_ids is not None


def _turn_spans(
    tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Full ids and per turn (start, content_start, end); content_start is only meaningful for
    assistant turns (after the generation prompt). Turn 0 starts at 0 (it includes any bos).
    `tools` are rendered as an episode renders them (`render_ids`)."""
    full = render_ids(tokenizer, messages, tools=tools)
    spans: list[tuple[int, int, int]] = []
    start = 0
    for k, msg in enumerate(messages):
        prefix = (
            full
            if k == len(messages) - 1
            else render_ids(tokenizer, messages[: k + 1], tools=tools)
        )
        if full[: len(prefix)] != prefix:
            raise ValueError(f"chat template is not prefix-stable: turn {k} re-renders differently")
        content_start = start
        if msg["role"] == "assistant":
            if k == 0:
                raise ValueError("a trace cannot start with an assistant turn")
            header = render_ids(tokenizer, messages[:k], add_generation_prompt=True, tools=tools)
            if full[: len(header)] != header:
                raise ValueError(
                    f"chat template is not prefix-stable: generation prompt at turn {k}"
                )
            content_start = len(header)
        spans.append((start, content_start, len(prefix)))
        start = len(prefix)
    return full, spans


def first_error_turn(messages: list[Message]) -> int | None:
    """Index of the first message whose `tool_error` field is not None."""
    return next((i for i, m in enumerate(messages) if m.get("tool_error") is not None), None)


def multi_turn_sample(
    tokenizer: Any,
    messages: list[Message],
    hint: str | None = None,
    hint_role: str = "user",
    tools: list[dict[str, Any]] | None = None,
) -> TraceSample:
    """Tokenise a tool trace; with a hint and an error turn, build the hinted teacher.

    `tools` (OpenAI tool specs) are shown to the model as a tool episode shows them
    (`render_ids`: the template's own rendering, or the system message), in both contexts.

    The hint goes right after the first erroneous turn (`with_hint`: a message of its own, or
    appended to that turn's message with `hint_role="inline"`). A trace without an error turn,
    without a hint, or without an assistant turn after the error gets no teacher (nothing after
    the hint to supervise).

    Raises:
        ValueError: the tokenizer has no chat template, or it is not prefix-stable, so tokens
            cannot be aligned.
    """
    if not has_chat_template(tokenizer):
        raise no_template(tokenizer, "a multi-turn tool trace")
    student, spans = _turn_spans(tokenizer, messages, tools)
    response_mask = [False] * len(student)
    for (_, content_start, end), msg in zip(spans, messages, strict=True):
        if msg["role"] == "assistant":
            response_mask[content_start:end] = [True] * (end - content_start)
    error = first_error_turn(messages)
    no_teacher = TraceSample(
        student, response_mask, None, [-1] * len(student), [False] * len(student), error
    )
    recovers = error is not None and any(m["role"] == "assistant" for m in messages[error + 1 :])
    if hint is None or not recovers:
        return no_teacher
    assert error is not None
    teacher_messages = with_hint(messages, error, hint, hint_role)
    shift = len(teacher_messages) - len(messages)  # 1 for a message of its own, 0 inline
    teacher, teacher_spans = _turn_spans(tokenizer, teacher_messages, tools)
    positions = [-1] * len(student)
    sdpo_mask = [False] * len(student)
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        _, s_content, s_end = spans[k]
        _, t_content, t_end = teacher_spans[k if k <= error else k + shift]
        if s_end - s_content != t_end - t_content:
            raise ValueError(
                f"chat template is not prefix-stable: turn {k} changes length with the hint"
            )
        for t in range(s_content, s_end):
            p = t - s_content + t_content
            if teacher[p] != student[t]:
                raise ValueError(f"chat template is not prefix-stable: token mismatch at turn {k}")
            positions[t] = p
            sdpo_mask[t] = k > error
    return TraceSample(student, response_mask, teacher, positions, sdpo_mask, error)

"""LLM-judge score and hint providers: m votes per sample through a rollout engine.

Each sample is shown to a judge model `votes` times with a prompt template shipped in
`tasks/templates/`. The judge is either a served model (`OpenAIEngine`: any OpenAI-compatible
server, e.g. `vllm serve`; chat messages in, text out, the server applies its chat template) or
a local engine (`generate` on token ids, with the judge's tokenizer). Placeholders `{prompt}`
(the problem's chat as "role: content" lines), `{answer}` (the problem's "answer" field, or
empty) and `{response}` are substituted in one pass, literally: a placeholder inside the
substituted text (a task prompt that mentions "{response}") stays as it is.

Parsing (case-insensitive):
- Score votes: the *last* ``SCORE:`` in a vote decides, as the template asks for it at the end:
  ``SCORE: +1`` / ``SCORE: 1`` → +1, ``SCORE: -1`` → −1; anything else (no "SCORE:",
  "SCORE: 0", "SCORE: 0.5", "SCORE: 10") is no vote.
- Hint votes: the text after the first ``HINT:`` up to the end of the vote, stripped. Empty
  text or "none" / "n/a" (any case, trailing period allowed) is no hint.

Aggregation over the m votes of a sample (m counts every vote, parsable or not):
- Score: if strictly more than m/2 votes are +1 the score is 1.0; if strictly more than m/2 are
  −1 it is 0.0; otherwise None (no usable score: `has_reward=False`).
- Hint: accepted when strictly more than m/2 votes produced a hint; the accepted hint is the
  longest of them (the first such vote on ties). Otherwise None (`has_teacher=False`).
If the engine raises, every sample of the call gets None and is counted in `failures`. Votes
cut off by `max_tokens` are counted in `truncated` (logged as `rollout/judge_truncated`).
"""

from __future__ import annotations

import logging
import re
from importlib import resources
from typing import Any

from composer_lightning.chat.literal import literal_ids, render_literal
from composer_lightning.engines.base import ChatEngine, RolloutEngine, SamplingConfig
from composer_lightning.tasks.base import HintProvider, Problem, ScoreProvider

logger = logging.getLogger(__name__)

_SCORE = re.compile(r"SCORE:\s*([+-]?)\s*1(?!\d|\.\d)", re.IGNORECASE)
_ANY_SCORE = re.compile(r"SCORE:", re.IGNORECASE)
_HINT = re.compile(r"HINT:(.*)", re.IGNORECASE | re.DOTALL)
_NO_HINT = {"none", "n/a", "na", "no hint"}
_PLACEHOLDER = re.compile(r"\{(prompt|answer|response|next_state)\}")
_BOXED = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")
_MARKED_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


def load_template(name: str) -> str:
    """A judge template shipped in `composer_lightning/tasks/templates/` ("judge_score.txt")."""
    return resources.files("composer_lightning.tasks").joinpath("templates", name).read_text()


def parse_score(text: str) -> int | None:
    """+1, −1, or None for one judge vote; only the last "SCORE:" counts."""
    found = list(_ANY_SCORE.finditer(text))
    if not found:
        return None
    m = _SCORE.match(text, found[-1].start())
    if m is None:
        return None
    return -1 if m.group(1) == "-" else 1


def parse_hint(text: str) -> str | None:
    """The hint of one judge vote, or None (no "HINT:", empty, or "NONE")."""
    m = _HINT.search(text)
    if m is None:
        return None
    hint = m.group(1).strip()
    if not hint or hint.rstrip(".").strip().lower() in _NO_HINT:
        return None
    return hint


def majority_score(votes: list[int | None]) -> float | None:
    """1.0 / 0.0 on a strict ±1 majority of all votes (unparsable ones included), else None."""
    m = len(votes)
    if sum(v == 1 for v in votes) * 2 > m:
        return 1.0
    if sum(v == -1 for v in votes) * 2 > m:
        return 0.0
    return None


def accepted_hint(hints: list[str | None]) -> str | None:
    """The longest hint if strictly more than half of all votes produced one, else None."""
    given = [h for h in hints if h is not None]
    if len(given) * 2 <= len(hints):
        return None
    return max(given, key=len)  # max keeps the first of equal lengths


def parse_next_state_vote(text: str) -> tuple[int | None, str | None]:
    """One vote of the next-state judge (OpenClaw-RL's shape): the last `\\boxed{1}` /
    `\\boxed{-1}` / `\\boxed{0}` (+1, −1, 0; None without one) and the text between the
    first `[HINT_START]` and `[HINT_END]`, stripped (None without markers)."""
    boxed = _BOXED.findall(text)
    vote = int(boxed[-1]) if boxed and boxed[-1].lstrip("+-") in ("0", "1") else None
    marked = _MARKED_HINT.search(text)
    return vote, (marked.group(1).strip() if marked else None)


def next_state_hint(votes: list[tuple[int | None, str | None]], min_chars: int = 10) -> str | None:
    """OpenClaw-RL's hint selection: among the votes that say +1 and give a hint of more than
    `min_chars` characters, the longest (the first of equal lengths); None when there is none
    (the turn gets no teacher)."""
    valid = [h for v, h in votes if v == 1 and h is not None and len(h) > min_chars]
    return max(valid, key=len) if valid else None


def render_chat(messages: list[dict[str, Any]]) -> str:
    """A chat as plain "role: content" lines for a judge prompt."""
    return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)


#: the judge's default sampling temperature (OpenClaw-RL's PRM judge samples at 0.6)
JUDGE_TEMPERATURE = 0.6
#: a served judge's default reply budget: room for a reasoning model's thinking before its
#: verdict (OpenClaw-RL gives thousands of tokens)
SERVED_JUDGE_MAX_TOKENS = 4096
#: a local token-id engine's default (usually a small model sharing the trainer's machine)
LOCAL_JUDGE_MAX_TOKENS = 64


class _Judge:
    """Shared prompt building and voting through an engine."""

    default_template = ""

    def __init__(
        self,
        engine: RolloutEngine | ChatEngine,
        tokenizer: str | Any | None = None,
        votes: int = 3,
        template: str | None = None,
        sampling: SamplingConfig | None = None,
    ) -> None:
        if votes < 1:
            raise ValueError(f"votes must be >= 1, got {votes}")
        if tokenizer is None and not isinstance(engine, ChatEngine):
            raise ValueError(
                "a judge on a token-id engine needs the judge model's tokenizer; "
                "a served judge (OpenAIEngine) does not"
            )
        if isinstance(tokenizer, str):  # a local directory or hub id, as YAML configs give it
            from transformers import AutoTokenizer

            from composer_lightning.models.hub import TOKENIZER_FILE, resolve_model

            path = resolve_model(tokenizer, what="judge tokenizer", require=TOKENIZER_FILE)
            tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine = engine
        self.tokenizer: Any = tokenizer
        self.votes = votes
        self.template = template if template is not None else load_template(self.default_template)
        if sampling is None:  # OpenClaw-RL's judge sampling: a reasoning model thinks first
            eos = getattr(tokenizer, "eos_token_id", None)
            sampling = SamplingConfig(
                temperature=JUDGE_TEMPERATURE,
                max_tokens=SERVED_JUDGE_MAX_TOKENS
                if isinstance(engine, ChatEngine)
                else LOCAL_JUDGE_MAX_TOKENS,
                stop_token_ids=[] if eos is None else [eos],
            )
        self.sampling = sampling
        self.failures = 0
        self.truncated = 0

    def prompt_text(self, problem: Problem, completion: str) -> str:
        """The judge's user message for one sample (placeholders replaced in one pass)."""
        chat = problem.get("messages") or [{"role": "user", "content": problem.get("prompt", "")}]
        values = {
            "prompt": render_chat(chat),
            "answer": str(problem.get("answer", "")),
            "response": completion,
            "next_state": render_chat(problem.get("next_state") or []),
        }
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.template)

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of the judge prompt (chat template when the tokenizer has one), its text
        plain text: it quotes the judged conversation (a client's own words, in `serve`), whose
        special tokens' strings must not become the judge's control tokens (a forged turn
        ending the judge's prompt with a verdict of the client's choosing)."""
        if getattr(self.tokenizer, "chat_template", None):
            render = lambda chat, _: self.tokenizer.apply_chat_template(  # noqa: E731
                chat, tokenize=False, add_generation_prompt=True
            )
            return render_literal(self.tokenizer, render, [{"role": "user", "content": text}], None)
        return literal_ids(self.tokenizer, text, add_special_tokens=True)

    def vote_texts(
        self, problems: list[Problem], completions: list[str]
    ) -> list[list[str] | None] | None:
        """Decoded votes per sample, or None if the engine call failed (all counted); a sample
        whose own request failed (a served judge's conversation with no replies) gets None,
        counted in `failures`."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        if not problems:
            return []
        texts = [self.prompt_text(p, c) for p, c in zip(problems, completions, strict=True)]
        try:
            if isinstance(self.engine, ChatEngine):
                outs = self.engine.chat(
                    [[{"role": "user", "content": t}] for t in texts], self.votes, self.sampling
                )
            else:
                outs = self.engine.generate(
                    [self.prompt_ids(t) for t in texts], self.votes, self.sampling
                )
        except Exception as exc:
            self.failures += len(problems)
            logger.warning(
                "judge engine raised (%d samples get no judgement): %s: %s",
                len(problems),
                type(exc).__name__,
                exc,
            )
            return None
        self.truncated += sum(c.finish_reason == "length" for group in outs for c in group)
        self.failures += sum(not group for group in outs)
        return [
            [
                c.text
                if c.text is not None
                else self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                for c in group
            ]
            if group
            else None
            for group in outs
        ]


class LLMJudgeScore(_Judge, ScoreProvider):
    """Score provider: ±1 majority of `votes` judge calls → 1.0 / 0.0, otherwise None.

    Args:
        engine: a served judge (`OpenAIEngine`: chat messages in, text out) or any engine with
            `generate(prompts: list[list[int]], n, sampling)` (completions with `.token_ids`).
        tokenizer: for a token-id engine, the judge model's tokenizer, its directory or hub id
            (prompt encoding, vote decoding); not needed for a served judge.
        votes: m, the judge calls per sample.
        template: prompt text with `{prompt}`, `{answer}`, `{response}`; default
            `templates/judge_score.txt`.
        sampling: judge sampling; default OpenClaw-RL's: temperature 0.6 and 4,096 tokens for a
            served judge (a reasoning model thinks before its verdict), 64 for a local
            token-id engine; stop at the tokenizer's eos.
    """

    default_template = "judge_score.txt"

    def score(self, problems: list[Problem], completions: list[str]) -> list[float | None]:
        texts = self.vote_texts(problems, completions)
        if texts is None:
            return [None] * len(problems)
        return [
            None if group is None else majority_score([parse_score(t) for t in group])
            for group in texts
        ]


class LLMJudgeHint(_Judge, HintProvider):
    """Hint provider: accepted when a strict majority of `votes` give a hint; the longest wins.

    Args: as `LLMJudgeScore`; the default template is `templates/judge_hint.txt`.
    """

    default_template = "judge_hint.txt"

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        texts = self.vote_texts(problems, completions)
        if texts is None:
            return [None] * len(problems)
        return [
            None if group is None else accepted_hint([parse_hint(t) for t in group])
            for group in texts
        ]


def next_state_votes(
    judge: _Judge, problems: list[Problem], completions: list[str]
) -> list[list[tuple[int | None, str | None]] | None]:
    """The parsed votes (`parse_next_state_vote`) on each turn that has a next state; None for
    a turn without one (no judge call) and for every turn when the judge call failed."""
    asked = [k for k, p in enumerate(problems) if p.get("next_state")]
    out: list[list[tuple[int | None, str | None]] | None] = [None] * len(problems)
    texts = judge.vote_texts([problems[k] for k in asked], [completions[k] for k in asked])
    if texts is None:
        return out
    for k, group in zip(asked, texts, strict=True):
        out[k] = None if group is None else [parse_next_state_vote(t) for t in group]
    return out


class NextStateJudgeHint(_Judge, HintProvider):
    """Hint provider from a turn's next state, with OpenClaw-RL's prompt shape: the judge reads
    the turn together with the state that followed it, `(a_t, s_{t+1})`, `votes` times; each
    vote is `\\boxed{1}` with a hint between `[HINT_START]` and `[HINT_END]`, or
    `\\boxed{-1}`; the longest hint of more than `min_chars` characters among the +1 votes is
    accepted (`next_state_hint`). A turn without a next state (the episode's last) costs no
    judge call and gets no hint. The other arguments are `LLMJudgeScore`'s; the default
    template is `templates/judge_next_state.txt` (placeholders `{prompt}`: the turn's context,
    `{response}`, `{next_state}`).

    Args:
        min_chars: a shorter hint is not accepted.
    """

    default_template = "judge_next_state.txt"

    def __init__(self, *args: Any, min_chars: int = 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.min_chars = min_chars

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        return [
            None if votes is None else next_state_hint(votes, self.min_chars)
            for votes in next_state_votes(self, problems, completions)
        ]


class NextStateJudgeScore(_Judge, ScoreProvider):
    """Score provider from a turn's next state: OpenClaw-RL's PRM evaluation. The judge reads
    `(a_t, s_{t+1})` `votes` times; each vote is `\\boxed{1}`, `\\boxed{-1}` or `\\boxed{0}`;
    a strict majority of +1 scores +1.0, of −1 scores −1.0 (OpenClaw-RL's ±1 reward: with one
    sample per group there is no baseline, so a bad turn must score below 0); otherwise None
    (no usable score). A turn without a next state costs no call and gets no score.

    Args: as `LLMJudgeScore`; the default template is `templates/judge_next_state_score.txt`.
    """

    default_template = "judge_next_state_score.txt"

    def score(self, problems: list[Problem], completions: list[str]) -> list[float | None]:
        out: list[float | None] = []
        for votes in next_state_votes(self, problems, completions):
            value = None if votes is None else majority_score([v for v, _ in votes])
            out.append(None if value is None else 2.0 * value - 1.0)
        return out

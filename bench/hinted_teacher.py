"""Does the hinted teacher know the next step of a tool chain the student stops short of?

    python bench/hinted_teacher.py --model <SFT'd SmolLM2 export> [--problems 24] [--terms 3]
        [--max-tokens 64] [--threads 2] [--seed 12345] [--out hinted_teacher.json]

No training. For `problems` fresh `tool_calc` problems of `terms` numbers, the episode is given
its right first call (`add` on the first two numbers) and the tool's result; then the policy
replies greedily twice: as the student (that context) and as the hint heads' teacher (the
context with the partial-sum hint the task gives an answer that stops there, "1176 is the sum
of the first 2 numbers only: add 20 to it.", as a user message after the tool's reply). The
table counts, for each, the replies that call a tool, that make the right next call
(`add(partial, next number)`, complete, as the environment would run it) and that answer. A
teacher that makes the right call where the student answers holds what OPD and SDPO are to
teach; whether they carry it into the student is another matter (they score the student's own
tokens: docs/benchmarks/smollm2_tools.md, "After SFT").
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


def right_call(reply: str, partial: int, following: int) -> bool:
    """Whether `reply` holds a complete call of `add` on the partial sum and the next number
    (either order), read by the parser the tool environment reads calls with."""
    from composer_lightning.chat.tool_calls import find_tool_calls

    for body in find_tool_calls(reply, "hermes")[1]:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") != "add":
            continue
        arguments = call.get("arguments")
        if isinstance(arguments, dict) and sorted(arguments) == ["a", "b"]:
            values = [arguments["a"], arguments["b"]]
            if all(type(v) is int for v in values) and sorted(values) == sorted(
                (partial, following)
            ):
                return True
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model directory, hub id or .gguf file")
    ap.add_argument("--problems", type=int, default=24)
    ap.add_argument("--terms", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)  # the tool agent config's
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import torch

    from composer_lightning.chat.hints import with_hint
    from composer_lightning.chat.templates import render_ids
    from composer_lightning.envs.python_tools import CALL_CLOSE, CALL_OPEN
    from composer_lightning.tasks import get_task
    from composer_lightning.tasks.tool_calc import partial_sum_hint

    start = time.perf_counter()
    tokenizer, model = load_policy(args.model, args.threads)
    task = get_task("tool_calc", terms=args.terms)
    counts = {role: {"calls": 0, "right_call": 0, "answers": 0} for role in ("student", "teacher")}
    examples: dict[str, str] = {}
    for problem in task.samples(args.problems, seed=args.seed):
        tools = task.environment(problem).tools  # as the rollout shows them
        first, second, following = problem["terms"][:3]
        call = json.dumps({"name": "add", "arguments": {"a": first, "b": second}})
        context = [
            *problem["messages"],
            {"role": "assistant", "content": f"{CALL_OPEN}{call}{CALL_CLOSE}"},
            {"role": "tool", "content": str(first + second)},
        ]
        hint = partial_sum_hint(problem["terms"], first + second)
        contexts = {
            "student": context,
            "teacher": with_hint(context, len(context) - 1, hint, "user"),
        }
        for role, messages in contexts.items():
            ids = render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    do_sample=False,
                    max_new_tokens=args.max_tokens,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
            reply = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
            examples.setdefault(role, reply)
            calls = CALL_OPEN in reply
            counts[role]["calls"] += calls
            counts[role]["answers"] += not calls
            counts[role]["right_call"] += right_call(reply, first + second, following)

    head = (
        f"{args.model}: {args.problems} tool_calc problems of {args.terms} numbers after the right "
        f"first call, greedy, {args.max_tokens} new tokens; {time.perf_counter() - start:.0f} s"
    )
    print(head)
    print("| replies as | calls a tool | the right next call | answers |")
    print("|---|---|---|---|")
    for role, c in counts.items():
        print(f"| {role} | {c['calls']} | {c['right_call']} | {c['answers']} |")
    for role, reply in examples.items():
        print(f"{role}, first problem: {reply!r}")
    if args.out:
        Path(args.out).write_text(json.dumps({"setup": head, "counts": counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Re-measure the sparse-reward suite's figures on the shipped tiny policy (HF generate).

    OMP_NUM_THREADS=1 python bench/sparse_suite.py [--problems 1000] [--tasks carry subtract]
        [--json docs/sparse_suite.json]

For every task of `composer_lightning/tasks/suite.py`: plain and hinted accuracy, greedy and
sampled at the task's training temperature (`build_tiny.hint_accuracy`: the hint is the
verifier's hint for the policy's own answer), and the rank and probability of the right
answer's first token after the plain prompt and of its least likely token (teacher-forced) at
that temperature. Seeded (`PROBLEM_SEED`, `SAMPLE_SEED` of the suite): the same software stack
gives the same figures. Prints a table, the figures as they are recorded in the suite, and
writes them to `--json`. About 10–20 s per task of 1000 problems on one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from composer_lightning.assets.build_tiny import hint_accuracy  # noqa: E402
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from composer_lightning.tasks.base import Problem  # noqa: E402
from composer_lightning.tasks.suite import (  # noqa: E402
    MAX_PLAIN_SAMPLED,
    MIN_HINTED_SAMPLED,
    PROBLEM_SEED,
    PROBLEMS,
    SAMPLE_SEED,
    SUITE,
    SparseTask,
)


@torch.no_grad()
def answer_token_ranks(
    model: torch.nn.Module, tokenizer, problems: list[Problem], temperature: float
) -> list[tuple[int, float, int, float]]:
    """Per problem: (rank, probability) at `temperature` of the right answer's first token after
    the plain prompt, then of its least likely token with the earlier answer tokens given.
    Rank 1 is the policy's first choice."""
    out = []
    for problem in problems:
        text = tokenizer.apply_chat_template(
            problem["messages"], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(str(problem["answer"]), add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        probs = (logits / temperature).softmax(-1)  # [A, V]
        right = probs[torch.arange(len(answer)), torch.tensor(answer)]  # [A]
        ranks = (probs > right[:, None]).sum(-1) + 1  # [A]
        hardest = int(right.argmin())
        out.append((int(ranks[0]), float(right[0]), int(ranks[hardest]), float(right[hardest])))
    return out


def measure(model: torch.nn.Module, tokenizer, entry: SparseTask, n: int) -> dict[str, float]:
    """Every figure of one suite task (the names of `suite.FIGURES`)."""
    task = entry.build()
    problems = task.samples(n, seed=PROBLEM_SEED)
    plain_g, hinted_g = hint_accuracy(model, tokenizer, task, problems, True, SAMPLE_SEED)
    plain_s, hinted_s = hint_accuracy(
        model, tokenizer, task, problems, False, SAMPLE_SEED, entry.temperature
    )
    ranks = answer_token_ranks(model, tokenizer, problems, entry.temperature)
    first_rank, first_prob, hard_rank, hard_prob = zip(*ranks, strict=True)
    return {
        "plain_greedy": round(plain_g, 4),
        "hinted_greedy": round(hinted_g, 4),
        "plain_sampled": round(plain_s, 4),
        "hinted_sampled": round(hinted_s, 4),
        "first_rank_median": float(statistics.median(first_rank)),
        "first_prob_mean": float(f"{statistics.fmean(first_prob):.3g}"),
        "first_prob_median": float(f"{statistics.median(first_prob):.3g}"),
        "hardest_rank_median": float(statistics.median(hard_rank)),
        "hardest_prob_mean": float(f"{statistics.fmean(hard_prob):.3g}"),
    }


def table(figures: dict[str, dict[str, float]]) -> list[str]:
    lines = [
        "| task | kind | T | plain greedy | hinted greedy | plain sampled | hinted sampled | "
        "first token: median rank, mean p, median p | hardest token: median rank, mean p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        e = SUITE[name]
        lines.append(
            f"| {name} (`{e.task}` {json.dumps(e.task_args)}) | {e.kind} | {e.temperature} | "
            f"{f['plain_greedy']:.3f} | {f['hinted_greedy']:.3f} | {f['plain_sampled']:.3f} | "
            f"{f['hinted_sampled']:.3f} | {f['first_rank_median']:g}, "
            f"{f['first_prob_mean']:.3g}, {f['first_prob_median']:.3g} | "
            f"{f['hardest_rank_median']:g}, {f['hardest_prob_mean']:.3g} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=PROBLEMS, help="problems per task (>= 200)")
    ap.add_argument("--tasks", nargs="+", default=list(SUITE), choices=list(SUITE))
    ap.add_argument("--json", default=str(ROOT / "docs" / "sparse_suite.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = tiny_policy_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    figures = {name: measure(model, tokenizer, SUITE[name], args.problems) for name in args.tasks}
    print(
        f"tiny policy, {args.problems} problems per task (seed {PROBLEM_SEED}), sampling seed "
        f"{SAMPLE_SEED}, {time.perf_counter() - start:.0f} s; sparse: plain sampled <= "
        f"{MAX_PLAIN_SAMPLED}, hinted sampled >= {MIN_HINTED_SAMPLED}"
    )
    print("\n".join(table(figures)))
    for name, f in figures.items():
        ok = f["plain_sampled"] <= MAX_PLAIN_SAMPLED and f["hinted_sampled"] >= MIN_HINTED_SAMPLED
        recorded = SUITE[name].figures == f
        print(
            f"{name}: {'sparse' if ok else 'NOT sparse'}; "
            f"{'matches' if recorded else 'differs from'} the figures in tasks/suite.py"
        )
        if not recorded:
            print(f"    figures={json.dumps(f)}")
    out = {
        "problems": args.problems,
        "problem_seed": PROBLEM_SEED,
        "sample_seed": SAMPLE_SEED,
        "tasks": {
            name: {
                "kind": SUITE[name].kind,
                "task": SUITE[name].task,
                "task_args": SUITE[name].task_args,
                "temperature": SUITE[name].temperature,
                "figures": f,
            }
            for name, f in figures.items()
        },
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Write demonstrations of the tool task (`tool_calc`) as a trace file for `SFTHead`.

Each line is a right episode: the question, the Hermes call of `add`, the tool's result, "The
answer is N.", with the tool specs the model is shown and `reward: 1.0`. Problems in the
held-out split (`rollout.validation.is_heldout` at `RolloutDataModule`'s default fraction) are
never written, so an evaluation after SFT measures problems it never saw.

    python examples/tool_sft/make_demos.py --n 512 --out examples/tool_sft/tool_calc_demos.jsonl
"""

from __future__ import annotations

import argparse
import json
import random

from composer_lightning.rollout.validation import is_heldout
from composer_lightning.tasks.tool_calc import ToolCalc


def demos(n: int, seed: int, val_fraction: float = 0.2) -> list[dict]:
    task, rng, out = ToolCalc(), random.Random(seed), []
    while len(out) < n:
        problem = task.sample(rng)
        if not is_heldout(problem, val_fraction):
            out.append(task.demonstration(problem))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="demonstrations to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        for record in demos(args.n, args.seed):
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

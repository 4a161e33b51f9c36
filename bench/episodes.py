"""Agent episodes with tools that take real time: environment calls one after another vs
concurrent, in one run.

    python bench/episodes.py [--delays 0 0.05 0.5] [--workers 1 32] [--steps 5]

The tool task (`tool_calc`: episodes of up to 3 turns, a calculator tool) on the shipped tiny
tool policy with the transformers engine (`HFEngine`), 8 prompts × G = 4 = 32 episodes a step,
its tool made to sleep `delay` seconds per call (a search, a sandbox, a browser), trained with
Dr. GRPO for `--steps` steps at each `env_workers` (1: every call of every episode in turn;
32: all of a turn's calls side by side). Each configuration is one `fit` in this process; its
step is timed start to start, everything in, the median after one warm-up step. The table
gives the step time, the tool calls a step made, episodes/s and the step's time against the
same concurrency with an instant tool (goal: a 500 ms tool < 1.2× an instant one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from composer_lightning.tasks.tool_calc import ToolCalc, add  # noqa: E402

WARMUP = 1
EPISODES = 8 * 4


class SlowToolCalc(ToolCalc):
    """`tool_calc` whose `add` sleeps `delay` seconds per call (and counts its calls)."""

    name = "slow_tool_calc"
    calls = 0

    def __init__(self, delay: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay = float(delay)

    def environment(self, problem):
        from composer_lightning.envs.python_tools import PythonToolEnv

        delay = self.delay

        def slow_add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first number.
                b: the second number.

            Returns:
                The sum a + b.
            """
            SlowToolCalc.calls += 1
            time.sleep(delay)
            return add(a, b)

        slow_add.__name__ = "add"
        return PythonToolEnv([slow_add], max_calls=self.max_calls, timeout=self.timeout)


def run(delay: float, workers: int, steps: int) -> dict:
    """One fit of `steps` steps; the median step time after the warm-up and calls per step."""
    import lightning as L
    import torch

    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import HFEngine, SamplingConfig
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.models.tiny import tiny_tool_policy_path
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.tasks import ToolErrorHint
    from composer_lightning.training.module import ComposerModule

    starts: list[float] = []
    calls: list[int] = []

    class Clock(L.Callback):  # first in the list: its start comes before generation
        def on_train_batch_start(self, *args):
            starts.append(time.perf_counter())
            calls.append(SlowToolCalc.calls)

    policy = tiny_tool_policy_path()
    callback = RolloutCallback(
        HFEngine(model_path=policy, seed=0),
        group_size=4,
        sampling=SamplingConfig(temperature=0.7, max_tokens=32, seed=0),
        hint=ToolErrorHint(),
        max_turns=3,
        max_episode_tokens=192,
        env_workers=workers,
        samples_every_n_steps=0,
    )
    module = ComposerModule(
        policy, [DrGRPOHead()], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4)
    )
    data = RolloutDataModule(
        task="episodes.SlowToolCalc",  # this module, imported as `episodes` (see the end)
        task_args={"delay": delay},
        prompts_per_step=8,
        val_prompts=0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=WARMUP + steps + 1,  # the last start closes the last timed step
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Clock(), callback],
    )
    trainer.fit(module, data)
    times = [b - a for a, b in zip(starts, starts[1:], strict=False)][WARMUP:]
    made = [b - a for a, b in zip(calls, calls[1:], strict=False)][WARMUP:]
    return {"step_s": statistics.median(times), "calls": statistics.median(made)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.5])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 1 warm-up)")
    args = ap.parse_args()
    results = {}
    for workers in args.workers:
        for delay in args.delays:
            results[(workers, delay)] = run(delay, workers, args.steps)
            r = results[(workers, delay)]
            print(f"workers {workers} delay {delay:g} s: {r['step_s']:.2f} s/step", flush=True)
    print()
    print(
        "| env_workers | tool delay s | s/step | tool calls/step | episodes/s | vs instant tool |"
    )
    print("|---|---|---|---|---|---|")
    for (workers, delay), r in results.items():
        base = results.get((workers, 0.0))
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "—"
        print(
            f"| {workers} | {delay:g} | {r['step_s']:.2f} | {r['calls']:.0f} | "
            f"{EPISODES / r['step_s']:.1f} | {ratio} |"
        )


if __name__ == "__main__":
    # run as the module `episodes`, so that the task's class path names this very code (and
    # the calls it counts are those this run reads)
    sys.path.insert(0, str(Path(__file__).parent))
    import episodes

    episodes.main()

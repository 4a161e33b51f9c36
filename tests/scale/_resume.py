"""Two FSDP2 ranks on the real rollout path, checkpointed every 2 steps; every rank saves what
it ended with (tests/scale/test_resume.py).

    MAX_STALENESS=k EPISODES=0|1 python tests/scale/_resume.py {whole|killed|resumed|tp2} OUT [CKPT]

`whole` runs STEPS steps; `killed` is the same run, SIGKILLed with all its ranks at the start of
step KILL_AT (after the step-2 checkpoint); `resumed` resumes from CKPT and runs to STEPS.
`tp2` asks for tensor_parallel_size=2: each rank writes its one-line error to OUT.rank<r>.err
and exits with status 3. With MAX_STALENESS=k > 0 every rank generates k batches ahead in an
engine process of its own. With EPISODES=1 the rollouts are
the tool task's episodes of up to 3 turns (the tiny tool policy), generated ahead whole with k >
0. Start it in a new session: `killed` kills its process group (both
ranks; Lightning starts rank 1 as a child of rank 0), so no rank is left waiting in a
collective.

Both ranks seed torch and Python alike, then draw from the global RNGs a rank-dependent amount
every step (as dropout or a user's callback would), so their RNG states differ from step 1.
"""

import os
import random
import signal
import sys
import warnings
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig, iter_hf_weights
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.models.tiny import tiny_policy_path, tiny_tool_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.rollout.teacher_guard import TeacherGuard
from composer_lightning.tasks import ToolErrorHint, VerifierHint
from composer_lightning.training.module import ComposerModule

STEPS, KILL_AT = 4, 3
MAX_STALENESS = int(os.environ.get("MAX_STALENESS", "0"))  # generation ahead by this many
EPISODES = os.environ.get("EPISODES", "0") == "1"  # the tool task's multi-turn episodes
# the weights saved are those after the step's update, which is what resuming needs
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


class Record(L.Callback):
    """Each step's prompts and global-RNG draws on this rank (the draws move the RNGs)."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        n = trainer.global_rank + 1
        seen = trainer.callback_metrics
        self.steps[trainer.global_step] = {
            "staleness": float(seen["rollout/staleness"]),
            "teacher_off": float(seen.get("hint/teacher_off", float("nan"))),
            "gap": float(seen.get("rollout/logprob_gap_max", float("nan"))),
            "prompts": [p["messages"][0]["content"] for p in batch.problems],
            "torch": torch.rand(n),
            "python": [random.random() for _ in range(n)],
        }


class KillAll(L.Callback):
    """SIGKILL to this run's process group (every rank, no handler runs) when step `step`
    starts; the test started the run in its own session."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def main(kind: str, out: str, ckpt: str | None) -> None:
    torch.manual_seed(0)
    random.seed(0)
    record = Record()
    callbacks = [
        RolloutCallback(
            HFEngine(seed=0),
            group_size=4,
            sampling=SamplingConfig(max_tokens=32 if EPISODES else 6, seed=0),
            hint=ToolErrorHint() if EPISODES else VerifierHint(),
            samples_every_n_steps=0,
            max_staleness=MAX_STALENESS,
            # generated ahead, no engine of the trainer's checks the hints; tool errors cannot be
            hint_trust="always" if MAX_STALENESS or EPISODES else "knows_better",
            **({"max_turns": 3, "max_episode_tokens": 192} if EPISODES else {}),
        ),
        record,
        ModelCheckpoint(
            dirpath=os.path.join(os.path.dirname(out), "checkpoints"),
            filename="{step}",
            every_n_train_steps=2,
            save_top_k=-1,
        ),
    ]
    if not (MAX_STALENESS or EPISODES):
        # the teacher guard told the student was right on 800 of 800 before: the tiny model's
        # step-1 check is a fall, so the teacher is off from step 2, a state in the step-2
        # checkpoint that the resumed run must keep (a fresh guard would stop it at step 3)
        callbacks[0]._guard = TeacherGuard(window=1, min_share=0.0, base=(800.0, 800.0))
    if kind == "killed":
        callbacks.append(KillAll(KILL_AT))
    module = ComposerModule(
        tiny_tool_policy_path() if EPISODES else tiny_policy_path(),
        [
            DrGRPOHead(),
            OPDHead(weight=0.5),
            KLHead(kl_coef=0.01),  # a frozen reference, sharded and kept out of checkpoints
            ReplayDPOHead(weight=0.5, pairs_per_step=2),
        ],
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=1 if kind == "tp2" else 2,
            tensor_parallel_size=2 if kind == "tp2" else 1,
            timeout=timedelta(seconds=60),  # a rank left alone fails in a minute, not 30
        ),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    try:
        data = RolloutDataModule(task="tool_calc" if EPISODES else "arithmetic", prompts_per_step=2)
        trainer.fit(module, data, ckpt_path=ckpt)
    except Exception as exc:  # noqa: BLE001 - recorded for the test, then a non-zero exit
        with open(f"{out}.rank{trainer.global_rank}.err", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    weights = {n: t.clone() for n, t in iter_hf_weights(module.policy)}  # a collective: every rank
    result = {
        "global_step": trainer.global_step,
        "weights": weights,
        "buffer": module.heads[-1].buffer,
        "steps": record.steps,
    }
    torch.save(result, f"{out}.rank{trainer.global_rank}")
    trainer.strategy.barrier()
    # Skip interpreter teardown on every rank: gloo's threads can abort it after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # engine processes (spawned) import this file without running it
    main(sys.argv[1], sys.argv[2], sys.argv[3] if sys.argv[1] == "resumed" else None)

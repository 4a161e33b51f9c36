"""Two FSDP2 ranks on the real rollout path, one of them signalled, or their disk full
(tests/scale/test_stop.py).

    python tests/scale/_stop.py {signalled RANK SIGNUM | resumed CKPT | full {sharded|file}} OUT

`signalled` runs up to STEPS steps and sends SIGNUM to rank RANK alone (its own process, from
inside, in the middle of step SIGNAL_IN: deterministic, and to the kernel the same as a signal
from outside) while the other rank is not told; `resumed` resumes from CKPT and runs to STEPS;
`full` saves `checkpoints/last.ckpt` after every step (FSDP2's sharded directory, or one file
that rank 0 writes) and before step 2 leaves room for half of one more.
Each rank writes `OUT.rank<r>` (JSON): the global step it ended at, the exit status it ends
with and the steps it completed. Rank 0 (Lightning starts rank 1 as its child) also waits for
rank 1 and records its real exit status. Start it in a new session, so that a hang can be
killed with all its ranks.
"""

import json
import os
import sys
import time
import warnings
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from composer_lightning.callbacks.stop import _accept_exit_status
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.training.module import ComposerModule
from tests.helpers import SignalAt, fill_disk

STEPS, SIGNAL_IN = 5, 3  # the signal arrives while step 3 runs: both ranks stop after it
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


class Steps(L.Callback):
    """The steps this rank completed."""

    def __init__(self):
        self.done: list[int] = []

    def on_train_batch_end(self, trainer, *args):
        self.done.append(trainer.global_step)


class ExitTogether(L.Callback):
    """Rank 0 is Lightning's launcher: its child observer SIGKILLs it within 5 s of a child
    exiting non-zero. When both ranks end with the same error (exit 3), rank 1 may be out
    first; rank 0 must live to record its status, so the observer lets exit 3 be."""

    def on_fit_start(self, trainer, *args):
        if trainer.global_rank == 0:
            _accept_exit_status(3)


class FillHalf(L.Callback):
    """Rank 0 (the ranks share the disk) leaves room for half of `last.ckpt` in `directory`
    when step `step` starts."""

    def __init__(self, directory: str, step: int):
        self.directory, self.step = directory, step

    def on_train_batch_start(self, trainer, *args):
        if trainer.is_global_zero and trainer.global_step == self.step - 1:
            last = os.path.join(self.directory, "last.ckpt")
            files = (
                [os.path.join(last, f) for f in os.listdir(last)] if os.path.isdir(last) else [last]
            )
            size = sum(os.path.getsize(f) for f in files)
            fill_disk(self.directory, keep=size // 2)


def main(kind: str, args: list[str], out: str) -> None:
    torch.manual_seed(0)
    steps = Steps()
    callbacks = [
        RolloutCallback(
            HFEngine(seed=0),
            group_size=2,
            sampling=SamplingConfig(max_tokens=4, seed=0),
            samples_every_n_steps=0,
        ),
        steps,
    ]
    if kind == "signalled":
        callbacks.append(SignalAt(SIGNAL_IN - 1, int(args[1]), rank=int(args[0])))
    checkpoints = os.path.join(os.path.dirname(out), "checkpoints")
    if kind == "full":
        callbacks += [
            ModelCheckpoint(checkpoints, every_n_train_steps=1, save_top_k=0, save_last=True),
            FillHalf(checkpoints, 2),
            ExitTogether(),
        ]
    module = ComposerModule(
        tiny_policy_path(), [DrGRPOHead()], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2,
            tensor_parallel_size=1,
            save_distributed_checkpoint=args[-1:] != ["file"],
            timeout=timedelta(seconds=30),  # a rank left alone fails in 30 s, not 30 min
        ),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=kind == "full",
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=os.path.dirname(out),
        callbacks=callbacks,
    )
    status = 0
    try:
        trainer.fit(
            module,
            RolloutDataModule(prompts_per_step=2),
            ckpt_path=args[0] if kind == "resumed" else None,
        )
    except SystemExit as exc:  # a signal's stop: Lightning's SIGTERMException
        status = exc.code
    except Exception as exc:  # noqa: BLE001 - recorded for the test, then a non-zero exit
        status = f"{type(exc).__name__}: {exc}"
    record = {"global_step": trainer.global_step, "status": status, "done": steps.done}
    if trainer.global_rank == 0:  # rank 1 is rank 0's child: its real exit status
        launcher = trainer.strategy.launcher
        record["children"] = [p.wait(timeout=60) for p in getattr(launcher, "procs", [])]
        if kind == "signalled":
            # Outlive the children by more than Lightning's observer's 5 s poll: it sees rank
            # 1's 128 + signal while rank 0 runs and must let it be (it SIGKILLed rank 0 once).
            time.sleep(6)
    with open(f"{out}.rank{trainer.global_rank}", "w") as f:
        json.dump(record, f)
    # Skip interpreter teardown: gloo's threads can abort it after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 3)


if __name__ == "__main__":
    kind = sys.argv[1]
    main(kind, sys.argv[2:-1], sys.argv[-1])

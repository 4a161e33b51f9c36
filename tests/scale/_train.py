"""Train the composed module for a few steps under a strategy; every rank saves what it saw.

    python tests/scale/_train.py {ddp|fsdp2|fsdp2_micro|ddp_rollout|fsdp2_rollout|fsdp2_uneven|fsdp2_raise} OUT.pt

`ddp` / `fsdp2` train on synthetic batches without gradient clipping (the gradients themselves
are compared); the rollout kinds keep the module's defaults: clipping at `max_grad_norm=1.0`
and the canary at `max_logprob_gap="auto"`. `fsdp2_uneven`: rank 1 gets a constant reward on
every other sample, no score on the rest, and no hints (fewer samples than rank 0, an empty
replay buffer, no SDPO or OPD term, a placeholder teacher forward, placeholder forwards for
top-k OPD's candidates and for context distillation, which has no hinted reply there) while rank 0 gets the verifier's, two candidate hints each. `fsdp2_raise`: rank 1's reward function raises from the second step on, and
collectives time out after 120 s instead of 30 minutes, so a rank left waiting fails by itself.
`fsdp2_micro`: `fsdp2` in micro-batches, rank 0 under a 60-token budget and rank 1 under 20
(more forwards: rank 0 runs placeholders); both count the collectives that reduce gradients.
The reference (the KL head's, also read by replay DPO at use time) is a frozen copy of the
policy; the rollout kinds train with a separate teacher (the tiny policy's directory). Every
rank records each step's KL metrics and its share of the frozen models' parameter bytes.
A rank whose fit raises writes `{"step": global step, "error": one line}` to OUT.rank<r>.err,
waits until every rank has written its own, and exits with status 3.
"""

import datetime
import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig, iter_hf_weights
from composer_lightning.heads.context_distill import ContextDistillHead
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.heads.topk_opd import TopKOPDHead
from composer_lightning.models.factory import TinyLlama
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.rollout.hinted import HintedReplies
from composer_lightning.tasks import FunctionScore, VerifierHint, VerifierScore
from composer_lightning.training.canary import default_max_logprob_gap
from composer_lightning.training.module import ComposerModule

kind, out = sys.argv[1], sys.argv[2]
rollouts = kind.split("_")[-1] in ("rollout", "uneven", "raise")


def rank() -> int:
    return dist.get_rank()


calls = 0


def reward(problem, completion):  # rank 1: a constant (no group has two different rewards)
    global calls
    calls += 1
    if kind == "fsdp2_raise" and rank() == 1 and calls > 8:  # 8 samples a step: from step 1
        raise RuntimeError("this reward function is broken on rank 1")
    if kind == "fsdp2_uneven" and rank() == 1 and calls % 2:  # no score: the sample is dropped
        raise RuntimeError("no score for this sample")
    return 0.5 if rank() == 1 else VerifierScore().score([problem], [completion])[0]


class RankHint(VerifierHint):
    def hints(self, problems, completions):
        return [None] * len(problems) if rank() == 1 else super().hints(problems, completions)


# fsdp2_raise: a rank left waiting in a collective fails after 120 s, not 30 minutes
timeout = {"timeout": datetime.timedelta(seconds=120)} if kind == "fsdp2_raise" else {}
if kind.startswith("ddp"):
    strategy = DDPStrategy(process_group_backend="gloo", **timeout)
else:
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **timeout)
heads = [
    DrGRPOHead(),
    OPDHead(weight=0.5),
    SDPOHead(weight=0.1),
    KLHead(kl_coef=0.01),
    ReplayDPOHead(weight=0.1, pairs_per_step=2, reference="model"),
    TopKOPDHead(weight=0.5),  # rollout kinds: two candidate hints (rank 1 of uneven: none)
]
if rollouts:  # context distillation on the hinted replies (rank 1 of uneven: none, a placeholder)
    heads.append(ContextDistillHead(weight=0.1, min_reward=None))
flat = kind.endswith("_flat")  # signal-free updates, skipped (skip_signal_free_updates)
if flat:
    heads = [DrGRPOHead()]
kls: list[dict[str, float]] = []


class RecordKL(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        kls.append(
            {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("kl/")}
        )


def parameter_bytes(model) -> dict:
    """This rank's bytes of `model`'s parameters, the whole model's, and whether every
    parameter is sharded now (a DTensor; an unsharded one left after a forward is not)."""
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return {
        "local": sum(t.numel() * t.element_size() for t in local),
        "full": sum(p.numel() * p.element_size() for p in params),
        "sharded": all(hasattr(p, "to_local") for p in params),
    }


callbacks, seen = [RecordKL()], []
if rollouts:  # the real rollout path: tiny policy, HF engine on every rank, prompts by rank
    policy = tiny_policy_path()
    data = RolloutDataModule(prompts_per_step=2)
    uneven = kind != "fsdp2_rollout" and kind != "ddp_rollout"
    callbacks += [
        RolloutCallback(
            HFEngine(seed=0),
            group_size=4 if uneven else 2,
            sampling=SamplingConfig(max_tokens=6, seed=0),
            score=FunctionScore(reward) if uneven else None,
            hint=RankHint(candidates=2) if uneven else VerifierHint(candidates=2),
            hint_role="user",  # as these runs were set up: the clip binds on every step
            hinted_replies=HintedReplies(temperature=0.0),
            teacher_replies="all",  # likewise (below the mean the norm falls under the clip)
        )
    ]

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            rb, metrics = batch.rollout, trainer.callback_metrics
            seen.append(
                {
                    "prompts": [p["messages"][0]["content"] for p in batch.problems],
                    "gap": float(trainer.callback_metrics["rollout/logprob_gap_max"]),
                    "rewards": rb.rewards[rb.has_reward].tolist(),
                    "reward_mean": float(metrics["rollout/reward_mean"]),
                    "buffer": len(module.heads[4].buffer),
                    "grad_norm": float(metrics["train/grad_norm"]),  # before the clip
                    "max_gap": default_max_logprob_gap(trainer.precision, rb.engine_dtype),
                }
            )

    callbacks.append(Record())
else:
    policy = TinyLlama(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, seed=0)
    data = SyntheticRolloutDataModule(vocab_size=64, seed=0)
if flat:  # step 0: signal on rank 0 only; steps 1 and 2: none on either rank
    batches = data.train_dataloader

    def flat_batches():
        for step, batch in enumerate(batches()):
            if step > 0 or rank() == 1:
                batch.rewards = torch.ones_like(batch.rewards)
            yield batch

    data.train_dataloader = flat_batches

    class RecordSteps(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
            seen.append(
                {
                    "signal_free": float(trainer.callback_metrics["train/signal_free"]),
                    "weights": [t.detach().clone() for t in local],
                }
            )

    callbacks.append(RecordSteps())
micro, collectives = {}, {"n": 0}
if kind == "fsdp2_micro":  # before the processes start, each rank reads its own LOCAL_RANK
    micro = {"max_tokens_per_micro_batch": 20 if os.environ.get("LOCAL_RANK") == "1" else 60}
if kind in ("fsdp2", "fsdp2_micro"):
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            collectives["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
module = ComposerModule(
    policy,
    heads,
    teacher=tiny_policy_path() if kind.endswith("_rollout") else None,
    optimizer=(lambda p: torch.optim.AdamW(p, lr=1e-2))  # momentum: what a skip leaves out
    if flat
    else (lambda p: torch.optim.SGD(p, lr=0.1 if not rollouts else 1e-3)),
    **({} if rollouts else {"max_grad_norm": None}),
    # the rollout runs' figures were set with the teacher cap at 1.0: the clip binds every step
    **({"teacher_cap": 1.0} if rollouts else {}),
    **({"skip_signal_free_updates": True} if flat else {}),
    **micro,
)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=strategy,
    max_steps=3,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,  # the reward calls are counted from the first training step
    callbacks=callbacks,
)
try:
    trainer.fit(module, data)
except Exception as exc:  # noqa: BLE001 - recorded for the test, then a non-zero exit
    with open(f"{out}.rank{trainer.global_rank}.err", "w") as f:
        json.dump({"step": trainer.global_step, "error": f"{type(exc).__name__}: {exc}"}, f)
    if dist.is_initialized():
        dist.barrier()  # every rank's record is written before any rank exits
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)
weights = {n: t.clone() for n, t in iter_hf_weights(module.policy)}  # a collective: every rank
sharded = all(hasattr(p, "full_tensor") for p in module.policy.parameters())
frozen = {
    name: parameter_bytes(model)
    for name, model in (("reference", module.reference), ("teacher", module.teacher))
    if model is not None
}
torch.save(
    {
        "weights": weights,
        "sharded": sharded,
        "seen": seen,
        "kl": kls,
        "frozen": frozen,
        "collectives": collectives["n"],
    },
    f"{out}.rank{trainer.global_rank}",
)
trainer.strategy.barrier()
# Skip interpreter teardown on every rank: gloo's threads can abort it after the work is done.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

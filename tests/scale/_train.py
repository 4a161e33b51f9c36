"""Train the composed module for a few steps under a strategy; rank 0 saves the full weights.

    python tests/scale/_train.py {ddp|fsdp2|ddp_rollout|fsdp2_rollout} OUT.pt
"""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from composer_lightning.callbacks.rollout import RolloutCallback
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig, iter_hf_weights
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.models.factory import TinyLlama
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.module import ComposerModule
from composer_lightning.tasks import VerifierHint

kind, out = sys.argv[1], sys.argv[2]
rollouts = kind.endswith("_rollout")
strategy = {"ddp": DDPStrategy(process_group_backend="gloo"),
            "fsdp2": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)}[kind.split("_")[0]]
heads = [DrGRPOHead(), OPDHead(weight=0.5), SDPOHead(weight=0.1), KLHead(kl_coef=0.01),
         ReplayDPOHead(weight=0.1, pairs_per_step=2)]
callbacks, seen = [], []
if rollouts:  # the real rollout path: tiny policy, HF engine on every rank, prompts by rank
    policy = tiny_policy_path()
    data = RolloutDataModule(tokenizer=policy, prompts_per_step=2)
    callbacks = [RolloutCallback(HFEngine(model_path=policy, seed=0), group_size=2,
                                 sampling=SamplingConfig(max_tokens=6, seed=0), hint=VerifierHint())]

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append({"prompts": [p["messages"][0]["content"] for p in batch["problems"]],
                         "gap": float(trainer.callback_metrics["rollout/logprob_gap_max"])})
    callbacks.append(Record())
else:
    policy = TinyLlama(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, seed=0)
    data = SyntheticRolloutDataModule(vocab_size=64, seed=0)
module = ComposerModule(policy, heads, optimizer=lambda p: torch.optim.SGD(p, lr=0.1 if not rollouts else 1e-3),
                        max_grad_norm=None, max_logprob_gap=None)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=callbacks)
trainer.fit(module, data)
weights = {n: t.clone() for n, t in iter_hf_weights(module.policy)}  # a collective: every rank
sharded = all(hasattr(p, "full_tensor") for p in module.policy.parameters())
torch.save({"weights": weights, "sharded": sharded, "seen": seen}, f"{out}.rank{trainer.global_rank}")
trainer.strategy.barrier()
# Skip interpreter teardown on every rank: gloo's threads can abort it after the work is done.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

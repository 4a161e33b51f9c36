"""The main job without the command line: `L.Trainer` + `ComposerModule` + `RolloutCallback`.

    python examples/python_api.py                    # 200 steps, vLLM on CPU
    python examples/python_api.py --engine hf --max_steps 20

Everything the YAML configs set is a constructor argument here; the run's directory is the
logger's (`runs/python_api/version_N/`: TensorBoard logs, rollouts.jsonl, curves.png,
checkpoints/).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from composer_lightning.callbacks.curves import Curves
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig, VLLMEngine
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.tasks import VerifierHint, VerifierScore
from composer_lightning.training.module import ComposerModule


def main(argv: list[str] | None = None) -> ComposerModule:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--root", default="runs", help="where the run directory goes")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    policy = tiny_policy_path()  # a local directory or a hub id, e.g. "Qwen/Qwen2.5-0.5B-Instruct"
    module = ComposerModule(
        policy,
        heads=[
            DrGRPOHead(weight=1.0),
            OPDHead(weight=0.5),
            SDPOHead(weight=0.1, warmup_steps=20),
            ReplayDPOHead(weight=0.05, capacity=256, pairs_per_step=4),
        ],
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
    )
    engine = VLLMEngine(seed=0, kv_cache_gib=1) if args.engine == "vllm" else HFEngine(seed=0)
    rollout = RolloutCallback(
        engine,  # follows the policy's directory
        group_size=4,
        sampling=SamplingConfig(temperature=1.0, max_tokens=8, seed=0),  # the one temperature
        score=VerifierScore(),
        hint=VerifierHint(),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        val_check_interval=50,  # held-out evaluation every 50 rollout batches
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=TensorBoardLogger(args.root, name="python_api"),
        callbacks=[rollout, ModelCheckpoint(every_n_train_steps=50, save_last=True), Curves()],
        enable_model_summary=False,
    )
    trainer.fit(module, RolloutDataModule(task="arithmetic", prompts_per_step=8))
    return module


if __name__ == "__main__":
    main()

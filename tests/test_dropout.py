"""Dropout is off in every trainer forward: the old log-probs a recompute gives are the ones the
first update reads (ratio exactly 1), with dropout in the policy's attention and in LoRA."""

from __future__ import annotations

import pytest
import torch

from composer_lightning.datamodules.synthetic import synthetic_batch
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.dropout import without_dropout
from composer_lightning.training.module import ComposerModule
from tests.helpers import tiny_model


def dropping_policy(rate: float = 0.5) -> torch.nn.Module:
    """The tiny Llama with dropout in its attention (HF passes `attention_dropout` to the kernel
    in train mode), in train mode."""
    model = tiny_model()
    model.config.attention_dropout = rate
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = rate
    return model.train()


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def test_without_dropout_makes_train_mode_forwards_deterministic():
    model, ids = dropping_policy(), torch.randint(0, 64, (2, 12))
    torch.manual_seed(0)
    assert not torch.equal(forward(model, ids), forward(model, ids))  # live: two draws
    assert without_dropout(model) == 1  # the one attention layer's rate
    assert torch.equal(forward(model, ids), forward(model, ids))
    assert model.training and model.config.attention_dropout == 0.5  # the config is kept
    assert without_dropout(model) == 0


def ratio_at_the_first_update(module: ComposerModule) -> torch.Tensor:
    """`logprobs − old_logprobs` of the first of two updates, on the response tokens."""
    rb = synthetic_batch(torch.Generator().manual_seed(3), vocab_size=64)
    needs = module.objective.requirements_over(0, 2)
    targets = module.rollout_targets(rb, needs, updates=2)  # old log-probs recomputed, no grad
    ctx = module.step_context(rb, needs, targets)
    return (ctx.logprobs - targets.old_logprobs)[rb.response_mask]


def test_the_first_update_reads_the_old_logprobs_exactly_with_dropout_in_the_policy():
    module = ComposerModule(dropping_policy(), [DrGRPOHead()], ppo_epochs=2)
    assert torch.equal(
        ratio_at_the_first_update(module), torch.zeros_like(ratio_at_the_first_update(module))
    )


def test_the_same_with_lora_dropout():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1
    )
    module = ComposerModule(tiny_model().train(), [DrGRPOHead()], peft=config, ppo_epochs=2)
    with torch.no_grad():  # non-zero adapters, so their dropout would change the output
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    gap = ratio_at_the_first_update(module)
    assert torch.equal(gap, torch.zeros_like(gap))

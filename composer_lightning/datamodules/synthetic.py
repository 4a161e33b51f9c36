"""Synthetic rollout batches: random prompts and responses with rewards and hints.

A stand-in for the rollout side that exercises every head (no engine, no task): each batch has
P prompts × G samples, a random subset rewarded, a random subset hinted (the teacher context is
the prompt, then `hint_length` hint tokens, then the same response). Used by the quick demo and
the module's tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from composer_lightning.protocols.batch import RolloutBatch


def synthetic_batch(
    generator: torch.Generator,
    *,
    prompts: int = 2,
    group_size: int = 4,
    prompt_length: int = 6,
    response_length: int = 8,
    hint_length: int = 3,
    vocab_size: int = 128,
    reward_prob: float = 0.75,
    hint_prob: float = 0.5,
) -> RolloutBatch:
    """One random `RolloutBatch` with right-padded, variable-length responses."""
    g = generator
    B, P, R, H = prompts * group_size, prompt_length, response_length, hint_length
    T = P + R
    ids = torch.randint(3, vocab_size, (B, T), generator=g)
    lengths = torch.randint(1, R + 1, (B,), generator=g)  # response lengths
    pos = torch.arange(T)
    response_mask = (pos >= P) & (pos < P + lengths.unsqueeze(1))
    attention_mask = (pos < P + lengths.unsqueeze(1)).long()
    ids = ids.masked_fill(attention_mask == 0, 0)
    has_reward = torch.rand(B, generator=g) < reward_prob
    has_teacher = torch.rand(B, generator=g) < hint_prob
    keep = has_reward | has_teacher  # the fourth dispatch path (neither) is dropped
    keep[0] = True
    hint = torch.randint(3, vocab_size, (B, H), generator=g)
    teacher_ids = torch.cat([ids[:, :P], hint, ids[:, P:]], dim=1)
    teacher_mask = torch.cat(
        [attention_mask[:, :P], torch.ones(B, H, dtype=torch.long), attention_mask[:, P:]], dim=1
    )
    positions = torch.where(
        response_mask & has_teacher.unsqueeze(1), pos + H, torch.full_like(pos, -1)
    )
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rewards=torch.randint(0, 2, (B,), generator=g).float(),
        has_reward=has_reward,
        group_ids=torch.arange(prompts).repeat_interleave(group_size),
        max_response_length=R,
        has_teacher=has_teacher,
        teacher_input_ids=teacher_ids,
        teacher_attention_mask=teacher_mask,
        teacher_positions=positions,
        sdpo_mask=response_mask & has_teacher.unsqueeze(1),
    )
    return batch.select(torch.nonzero(keep).flatten())


class _Stream(IterableDataset):
    def __init__(self, seed: int, kwargs: dict):
        self.seed, self.kwargs = seed, kwargs

    def __iter__(self) -> Iterator[RolloutBatch]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield synthetic_batch(g, **self.kwargs)


class SyntheticRolloutDataModule(L.LightningDataModule):
    """An endless stream of synthetic rollout batches (see `synthetic_batch`); each rank draws
    its own stream."""

    def __init__(
        self,
        prompts: int = 2,
        group_size: int = 4,
        prompt_length: int = 6,
        response_length: int = 8,
        hint_length: int = 3,
        vocab_size: int = 128,
        reward_prob: float = 0.75,
        hint_prob: float = 0.5,
        seed: int = 0,
    ):
        super().__init__()
        self.seed = seed
        self.kwargs = dict(
            prompts=prompts,
            group_size=group_size,
            prompt_length=prompt_length,
            response_length=response_length,
            hint_length=hint_length,
            vocab_size=vocab_size,
            reward_prob=reward_prob,
            hint_prob=hint_prob,
        )

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else 0
        return DataLoader(_Stream(self.seed + 1000 * rank, self.kwargs), batch_size=None)

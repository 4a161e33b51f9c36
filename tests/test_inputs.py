"""Bad inputs found at setup, before the engine starts: one line each (`inputs.py`)."""

from __future__ import annotations

import json
import random

import pytest

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig, VLLMEngine
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.runtime.inputs import context_length, sized_context, tokens_needed
from composer_lightning.tasks import Task, Verdict
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer

POLICY = tiny_policy_path()


def _fit(module, dm, steps=1, **rollout):
    """Fit; whatever it raises is raised with `.engine_started` set on it."""
    engine = HFEngine(seed=0)  # follows the policy's directory
    cb = RolloutCallback(
        engine, group_size=2, sampling=SamplingConfig(max_tokens=6, seed=0), **rollout
    )
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=[cb],
    )
    try:
        trainer.fit(module, dm)
        return trainer
    except Exception as exc:
        exc.engine_started = engine.model is not None
        raise


def test_a_tokenizer_with_more_ids_than_the_policy_has_embedding_rows_is_one_line_at_setup(
    tmp_path,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(small).save_pretrained(tmp_path)
    module = ComposerModule(str(tmp_path), [DrGRPOHead()])
    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=2, val_prompts=0)
    with pytest.raises(ConfigError) as err:
        _fit(module, dm)
    assert str(err.value) == (
        "the tokenizer has 512 token ids but the policy's embedding has 64 rows (ids >= 64 would "
        "index past it): use the policy's own tokenizer"
    )
    assert not err.value.engine_started


def test_a_prompt_file_line_too_long_for_the_engine_is_one_line_at_setup_naming_file_and_line(
    tmp_path,
):
    path = tmp_path / "prompts.jsonl"
    # 253 tokens: within the context of 256 alone, not with max_tokens 6
    lines = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "1 + " * 83, "answer": 2}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dm = RolloutDataModule(
        tokenizer=POLICY, task="arithmetic", prompt_file=str(path), prompts_per_step=1
    )
    with pytest.raises(ConfigError) as err:
        _fit(ComposerModule(POLICY, [DrGRPOHead()]), dm)
    assert not err.value.engine_started
    assert str(err.value) == (
        f"prompt {path}:2 has 253 tokens: with max_tokens 6 it needs 259 positions, more "
        f"than the engine's context of 256 (max_position_embeddings of {POLICY}); shorten the "
        "prompt or lower sampling.max_tokens"
    )


def test_a_prompt_with_no_room_in_max_episode_tokens_is_one_line_at_setup(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "1 + " * 20, "answer": 2}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dm = RolloutDataModule(
        tokenizer=POLICY, task="arithmetic", prompt_file=str(path), prompts_per_step=1
    )
    with pytest.raises(ConfigError) as err:
        _fit(ComposerModule(POLICY, [DrGRPOHead()]), dm, max_episode_tokens=40)
    assert not err.value.engine_started
    n = len(dm.prompt_ids({"prompt": "1 + " * 20}))
    assert n >= 40
    assert str(err.value) == (
        f"prompt {path}:2 has {n} tokens, no room for a reply within "
        "rollout.max_episode_tokens=40; raise max_episode_tokens above the longest prompt or "
        "shorten the prompt"
    )


class LongFromTheSecondBatch(Task):
    """Short prompts for two batches of two (the setup check and the first step), then long."""

    name = "long_later"

    def __init__(self):
        self.calls = 0

    def sample(self, rng: random.Random) -> dict:
        self.calls += 1
        words = 2 if self.calls <= 4 else 300
        return {"task": f"{__name__}.{type(self).__name__}", "prompt": "1 + " * words}

    def verify(self, problem: dict, completion: str) -> Verdict:
        return Verdict(1.0)


def test_a_task_prompt_too_long_for_the_engine_is_one_line_before_its_batch_is_generated():
    dm = RolloutDataModule(
        tokenizer=POLICY,
        task=f"{__name__}.LongFromTheSecondBatch",
        prompts_per_step=2,
        val_fraction=0,
    )
    with pytest.raises(ConfigError, match=r"^prompt 0 of rollout batch 1 has \d+ tokens: with "):
        _fit(ComposerModule(POLICY, [DrGRPOHead()]), dm, steps=2)


def test_more_minibatches_than_groups_is_one_line_at_setup():
    module = ComposerModule(POLICY, [DrGRPOHead()], minibatches=3)
    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=2, val_prompts=0)
    with pytest.raises(ConfigError) as err:
        _fit(module, dm)
    assert str(err.value) == (
        "model.minibatches=3 but a rollout batch has 2 groups (one per prompt: "
        "data.prompts_per_step); minibatches split along groups: set minibatches <= 2"
    )
    assert not err.value.engine_started


def test_the_engine_context_is_its_max_model_len_else_the_model_config():
    assert context_length(VLLMEngine(model_path=POLICY, max_model_len=64), None) == (
        64,
        "VLLMEngine max_model_len",
    )
    assert context_length(VLLMEngine(model_path=POLICY), None) == (
        256,
        f"max_position_embeddings of {POLICY}",
    )
    assert context_length(HFEngine(), POLICY) == (256, f"max_position_embeddings of {POLICY}")


def test_the_run_needs_its_longest_prompt_and_reply_or_its_episode_budget():
    assert tokens_needed([5, 9, 7], 6) == 15
    assert tokens_needed([5, 9], 6, max_prompt_length=40) == 46  # bounds prompts not yet seen
    assert tokens_needed([5, 9], 6, max_episode_tokens=12) == 12
    assert tokens_needed([5, 9], 6, max_turns=3, max_episode_tokens=300) == 300
    assert tokens_needed([5, 9], 6, max_turns=3) is None  # episodes without a budget: unknown
    assert sized_context(15, 32768) == 256  # Gemma 3's "{a} + {b} =" with 6 new tokens
    assert sized_context(129, 32768) == 512  # twice 129: two blocks
    assert sized_context(3000, 4096) == 4096  # never above the model's own
    assert sized_context(15, None) == 256


class SizingEngine(HFEngine):
    """An engine that sizes its context to the run, recording what it was started with."""

    sizes_context = True

    context = None

    def start(self, context=None) -> None:
        self.context = self.context or context  # the callback's start, not later ones
        super().start(context)


def test_the_callback_gives_the_engine_the_need_its_checks_sized(tmp_path):
    """The engine's context and the checks' agree: the need handed to the engine is the
    longest prompt + max_tokens of the run, and the checks hold the size of that need."""
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "1 + " * 20, "answer": 2}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dm = RolloutDataModule(
        tokenizer=POLICY, task="arithmetic", prompt_file=str(path), prompts_per_step=1
    )
    engine = SizingEngine(seed=0)
    cb = RolloutCallback(engine, group_size=2, sampling=SamplingConfig(max_tokens=6, seed=0))
    quiet_trainer(max_steps=1, callbacks=[cb]).fit(ComposerModule(POLICY, [DrGRPOHead()]), dm)
    longest = max(len(dm.prompt_ids(line)) for line in lines)
    assert engine.context.tokens_needed == longest + 6
    limit, source = cb._context
    assert limit == context_length(engine, POLICY, longest + 6)[0] == 256
    assert source.startswith("SizingEngine's context sized for the run")


def test_a_base_model_prompt_too_long_is_the_same_one_line(tmp_path):
    """Without a chat template the prompt is its plain text: fewer tokens (no role markers),
    the same check and message. The vocabulary check passes on the base tokenizer."""
    from tests.helpers import base_model_dir

    base = base_model_dir(tmp_path)
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "1 + " * 84, "answer": 2}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dm = RolloutDataModule(tokenizer=base, task="arithmetic", prompt_file=str(path))
    with pytest.raises(ConfigError) as err:
        _fit(ComposerModule(base, [DrGRPOHead()]), dm)
    assert not err.value.engine_started
    assert str(err.value).startswith(f"prompt {path}:2 has 252 tokens: with max_tokens 6")


class NamedRows(Task):
    """A user's task whose rows name it by its short `name`, as the built-in tasks' rows do."""

    name = "named_rows"
    row_name = "named_rows"

    def sample(self, rng: random.Random) -> dict:
        return {"task": self.row_name, "prompt": "1 + 1 =", "answer": 2}

    def verify(self, problem: dict, completion: str) -> Verdict:
        return Verdict(1.0)


class BuiltinNamedRows(NamedRows):
    name = "builtin_named_rows"
    row_name = "arithmetic"  # a built-in task's name: would be scored by that task


def test_a_user_task_whose_rows_say_its_name_trains():
    dm = RolloutDataModule(
        tokenizer=POLICY, task=f"{__name__}.NamedRows", prompts_per_step=2, val_fraction=0
    )
    trainer = _fit(ComposerModule(POLICY, [DrGRPOHead()]), dm)
    assert trainer.callback_metrics["rollout/reward_mean"] == 1.0  # every row scored by it


def test_a_user_task_whose_rows_name_another_task_is_one_line_at_setup():
    dm = RolloutDataModule(
        tokenizer=POLICY, task=f"{__name__}.BuiltinNamedRows", prompts_per_step=2, val_fraction=0
    )
    with pytest.raises(ConfigError) as err:
        _fit(ComposerModule(POLICY, [DrGRPOHead()]), dm)
    assert not err.value.engine_started
    assert str(err.value) == (
        f"data.task '{__name__}.BuiltinNamedRows' writes rows with \"task\": 'arithmetic', "
        "which does not name it (that is composer_lightning.tasks.arithmetic.Arithmetic); "
        f"write \"task\": '{__name__}.BuiltinNamedRows' in its rows, or a name no built-in "
        "task has"
    )

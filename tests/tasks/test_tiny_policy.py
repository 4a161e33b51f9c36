"""The shipped tiny policy: offline loading, checksums, and a hint that measurably helps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from composer_lightning.assets.build_tiny import hint_accuracy
from composer_lightning.models.tiny import (
    CHECKSUMS,
    file_checksums,
    tiny_policy_path,
    verify_checksums,
)
from composer_lightning.tasks import Arithmetic, ReverseDigits


@pytest.fixture(scope="module")
def policy():
    # a local directory: from_pretrained never touches the hub
    path = tiny_policy_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def test_files_and_checksums() -> None:
    root = Path(tiny_policy_path())
    names = {p.name for p in root.iterdir()}
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
        "build_info.json",
        CHECKSUMS,
    ):
        assert name in names
    verify_checksums(root)
    assert sum(p.stat().st_size for p in root.iterdir()) < 8 * 2**20


def test_checksum_mismatch_is_detected(tmp_path: Path) -> None:
    root = Path(tiny_policy_path())
    for name in file_checksums(root):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    (tmp_path / CHECKSUMS).write_text((root / CHECKSUMS).read_text())
    verify_checksums(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json"):
        verify_checksums(tmp_path)


def test_loads_offline_as_llama_with_the_trained_tokenizer(policy) -> None:
    model, tokenizer = policy
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM CPU attention
    assert cfg.vocab_size == len(tokenizer)
    assert next(model.parameters()).dtype == torch.float32
    assert 200_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>",
        "<|eot|>",
        "<|pad|>",
    )
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    ids = tokenizer("What is 13 + 4?", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "What is 13 + 4?"
    assert "1" in tokenizer.convert_ids_to_tokens(ids)  # digits are single tokens
    info = json.loads((Path(tiny_policy_path()) / "build_info.json").read_text())
    assert info["vocab_size"] == len(tokenizer)


@pytest.mark.parametrize(
    ("task", "greedy_margin"), [(Arithmetic(), 0.2), (ReverseDigits(), 0.0)], ids=["arith", "rev"]
)
def test_hint_in_context_helps(policy, task, greedy_margin: float) -> None:
    """Greedy and sampled (T=1) accuracy on 64 fixed problems, without and with the verifier's
    hint for the model's own plain answer (build_info.json has the 200-problem numbers)."""
    model, tokenizer = policy
    torch.set_num_threads(1)
    problems = task.samples(64, seed=99)
    plain, hinted = hint_accuracy(model, tokenizer, task, problems, greedy=True)
    assert hinted > plain + greedy_margin, (plain, hinted)
    plain_t1, hinted_t1 = hint_accuracy(model, tokenizer, task, problems, greedy=False, seed=3)
    assert hinted_t1 > plain_t1 + 0.2, (plain_t1, hinted_t1)
    if task.name == "arithmetic":
        assert 0.3 <= plain <= 0.75 and 0.3 <= plain_t1 <= 0.75  # "sometimes right"


def test_the_carry_task_is_sparse_and_the_hint_makes_it_dense(policy) -> None:
    """`Arithmetic(carry_only=True)` at the sparse config's temperature 0.6: the policy is
    rarely right alone and mostly right with the verifier's hint (on 100 fresh problems; the
    build's 300-problem figures are in build_info.json, checked here too)."""
    model, tokenizer = policy
    torch.set_num_threads(1)
    task = Arithmetic(carry_only=True)
    problems = task.samples(100, seed=42)
    plain, hinted = hint_accuracy(
        model, tokenizer, task, problems, greedy=False, seed=5, temperature=0.6
    )
    assert plain <= 0.12 and hinted >= 0.8, (plain, hinted)
    greedy_plain, greedy_hinted = hint_accuracy(model, tokenizer, task, problems, greedy=True)
    assert greedy_plain <= 0.05 and greedy_hinted >= 0.9, (greedy_plain, greedy_hinted)
    info = json.loads((Path(tiny_policy_path()) / "build_info.json").read_text())
    assert info["arithmetic_carry/sampled_t0.6/plain_accuracy"] <= 0.10
    assert info["arithmetic_carry/greedy/plain_accuracy"] <= 0.10
    assert info["arithmetic_carry/sampled_t0.6/hinted_accuracy"] >= 0.60

"""The shipped tiny tool policy: files and checksums, its tool template, measured episodes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from composer_lightning.assets.build_tiny_tool import (
    TOOL_CHAT_TEMPLATE,
    encode_episode,
    run_episodes,
    scripted_episode,
)
from composer_lightning.envs import PythonToolEnv
from composer_lightning.models.tiny import CHECKSUMS, tiny_tool_policy_path, verify_checksums
from composer_lightning.tasks.tool_calc import ToolCalc, add

ROOT = Path(tiny_tool_policy_path())
TOOLS = PythonToolEnv([add]).tools


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ROOT))


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(str(ROOT), dtype=torch.float32).eval()


def test_files_match_their_checksums() -> None:
    names = {p.name for p in ROOT.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "build_info.json"):
        assert name in names
    assert CHECKSUMS in names
    verify_checksums(ROOT)
    assert sum(p.stat().st_size for p in ROOT.iterdir()) < 5 * 2**20


def test_loads_offline_as_llama(model, tokenizer) -> None:
    assert isinstance(model, LlamaForCausalLM)
    assert (
        model.config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|eot|>")
    )
    assert tokenizer.chat_template == TOOL_CHAT_TEMPLATE


def test_the_template_renders_tools_and_each_role(tokenizer) -> None:
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": "T"},
    ]
    text = tokenizer.apply_chat_template(
        chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|bos|><|system|>Tools: add(a: int, b: int)<|eot|><|system|>S<|eot|><|user|>U<|eot|>"
        "<|assistant|>A<|eot|><|tool|>T<|eot|><|assistant|>"
    )
    no_tools = tokenizer.apply_chat_template(chat[:2], tokenize=False)
    assert no_tools == "<|bos|><|system|>S<|eot|><|user|>U<|eot|>"
    with pytest.raises(Exception, match="unknown role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def _ids(tokenizer, messages, generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("seed", range(6))
def test_the_template_is_prefix_stable_over_a_whole_tool_episode(tokenizer, seed) -> None:
    rng = random.Random(seed)
    problem = ToolCalc().make(rng.randint(10, 999), rng.randint(10, 999), seed % 2)
    messages = scripted_episode(problem, rng)
    assert "tool" in {m["role"] for m in messages}
    for k in range(1, len(messages)):
        shorter, longer = _ids(tokenizer, messages[:k]), _ids(tokenizer, messages[: k + 1])
        assert longer[: len(shorter)] == shorter
        if messages[k]["role"] == "assistant":
            # the generation prompt, then what the engine generates: the content ids and eos
            prompt = _ids(tokenizer, messages[:k], generation_prompt=True)
            content = tokenizer(messages[k]["content"], add_special_tokens=False)["input_ids"]
            assert longer == prompt + content + [tokenizer.eos_token_id]
    ids, mask = encode_episode(tokenizer, messages, TOOLS)
    assert ids == _ids(tokenizer, messages)
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "".join(
        m["content"] + "<|eot|>" for m in messages if m["role"] == "assistant"
    )


def test_build_info_has_the_measured_episode_figures() -> None:
    info = json.loads((ROOT / "build_info.json").read_text())
    assert info["episodes"] >= 200 and info["max_turns"] == 3
    for mode in ("greedy", "sampled_t1", "sampled_t0.7"):
        figures = {k: info[f"tool_calc/{mode}/{k}"] for k in _FIGURES}
        assert all(0.0 <= v <= 1.0 for v in figures.values())
        assert figures["hinted/success"] > figures["plain/success"] + 0.2
        assert 0.1 < figures["first_call_error_rate"] < 0.9
        assert figures["hinted_recovery_rate"] > figures["plain/retry_good_call_rate"]


_FIGURES = (
    "plain/success",
    "hinted/success",
    "first_call_error_rate",
    "plain/retry_good_call_rate",
    "hinted/retry_good_call_rate",
    "hinted_recovery_rate",
)


def test_greedy_episodes_call_the_tool_and_a_hint_helps(model, tokenizer) -> None:
    task = ToolCalc()
    problems = [task.make(123 + 7 * i, 45 + 11 * i, i % 2) for i in range(12)]
    plain = run_episodes(model, tokenizer, problems)
    hinted = run_episodes(model, tokenizer, problems, hinted=True)
    assert all(r["chat"][1]["content"].startswith("<tool_call>") for r in plain)
    assert sum(r["success"] for r in hinted) > sum(r["success"] for r in plain)
    good = next(r for r in plain if r["success"])
    assert good["chat"][-1]["content"] == f"The answer is {good['chat'][-2]['content']}."

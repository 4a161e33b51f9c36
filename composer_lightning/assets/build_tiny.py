"""Build the shipped tiny policy offline: tokenizer, Llama, warm start, evaluation, checksums.

Rebuild (deterministic: same files, same `CHECKSUMS.sha256`, on the same software stack)::

    OMP_NUM_THREADS=1 python -m composer_lightning.assets.build_tiny \
        --out composer_lightning/assets/tiny_policy

What the warm start teaches (a plain torch loop, 1 thread, seed 0, about 3 minutes idle): chat
formatted problems of the default `Arithmetic()` (a + b, 0–20) and `ReverseDigits()` tasks →
answers, with deliberately noisy targets so the policy is *sometimes right*:
- plain prompts: "hard" problems get a systematic error 80% of the time, the others a random
  near miss 10% of the time. Arithmetic: a problem with a units carry is hard, its error
  forgets the carry (answer − 10), about 45% of the default problems. Reverse: inputs of 4 or
  more digits are hard, their error swaps two adjacent digits.
- hinted prompts (the prompt, then the verifier's hint for a wrong attempt as an extra user —
  or, 20% of the time, system — message): the target is always right.
So plain arithmetic accuracy lands near 60% and a hint in context measurably helps; the measured
numbers are written to `build_info.json`. The carries (`Arithmetic(carry_only=True)`: greedy 0%
and, sampled at temperature 0.6, 6% right alone, 95% with the hint, `arithmetic_carry/...`) are
one task of the sparse-reward suite (`tasks/suite.py`, at temperature 0.3 there; its figures are
measured by `bench/sparse_suite.py`). Simplified on purpose: a single fixed data mix, no
validation split (the policy is a test fixture, not a model).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from composer_lightning.models.tiny import tiny_llama_config, train_tokenizer, write_checksums
from composer_lightning.tasks.arithmetic import Arithmetic
from composer_lightning.tasks.base import Problem, Task
from composer_lightning.tasks.reverse import ReverseDigits

SEED = 0
ARITHMETIC_SHARE = 0.75  # of the warm-start examples; the rest are ReverseDigits


def hinted_messages(problem: Problem, hint: str, role: str = "user") -> list[dict[str, str]]:
    """The problem's chat with `hint` appended as one more `role` message (the teacher prompt)."""
    return [*problem["messages"], {"role": role, "content": hint}]


def wrong_guess(problem: Problem) -> str:
    """A fixed wrong answer of a problem (used to derive a hint when the student was right)."""
    answer = str(problem["answer"])
    if problem["task"] == "arithmetic":
        return str(int(answer) + 1)
    return str((int(answer[0]) + 1) % 10) + answer[1:]


def _near_miss(answer: int, rng: random.Random) -> int:
    delta = rng.choice([-2, -1, 1, 2])
    return answer + delta if answer + delta >= 0 else answer - delta


def training_example(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    """One (chat, target response) pair of the warm-start mix."""
    if rng.random() < ARITHMETIC_SHARE:
        task: Task = Arithmetic()
        problem = task.sample(rng)
        answer = int(problem["answer"])
        hard = problem["a"] % 10 + problem["b"] % 10 >= 10  # a units carry: "forgets" it
        wrong = str(answer - 10 if hard else _near_miss(answer, rng))
        right = rng.random() < (0.2 if hard else 0.9)
    else:
        task = ReverseDigits()
        problem = task.sample(rng)
        answer_s = problem["answer"]
        n = len(answer_s)
        hard = n >= 4  # long inputs: two adjacent digits come out swapped
        i = sum(map(int, answer_s)) % (n - 1) if hard else rng.randrange(n)
        if hard and answer_s[i] != answer_s[i + 1]:
            wrong = answer_s[:i] + answer_s[i + 1] + answer_s[i] + answer_s[i + 2 :]
        else:
            digit = str((int(answer_s[i]) + rng.randint(1, 9)) % 10)
            wrong = answer_s[:i] + digit + answer_s[i + 1 :]
        right = rng.random() < (0.2 if hard else 0.9)
    if rng.random() < 0.5:
        return problem["messages"], str(problem["answer"]) if right else wrong
    guess = "" if rng.random() < 0.1 else wrong
    hint = task.verify(problem, guess).hint
    assert hint is not None
    role = "system" if rng.random() < 0.2 else "user"
    return hinted_messages(problem, hint, role), str(problem["answer"])


def tokenizer_corpus(n: int = 4000) -> list[str]:
    """Generated text the tokenizer is trained on (prompts, hints, answers)."""
    rng = random.Random(SEED)
    texts: list[str] = []
    for _ in range(n):
        messages, response = training_example(rng)
        texts.extend(m["content"] for m in messages)
        texts.append(response)
    # Text beyond the warm-start mix, so chats with tools and judge prompts tokenise sensibly.
    templates = Path(__file__).resolve().parent.parent / "tasks" / "templates"
    texts.extend(p.read_text() for p in sorted(templates.glob("*.txt")))
    for _ in range(n // 4):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        texts += [
            f'call calculator {{"expression": "{a} + {b}"}}',
            f"Tool error: cannot parse expression {a} +* {b}. Check the syntax and try again.",
            f"The tool returned {a + b}. The result is {a + b}.",
            "You are a helpful assistant. Use the tools when needed; think step by step.",
            "Hint: read the error message of the tool carefully, then fix the call.",
        ]
    return texts


def encode_example(
    tokenizer: Any, messages: list[dict[str, str]], response: str
) -> tuple[list[int], int]:
    """(prompt ⊕ response ⊕ eot ids, prompt length)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    resp = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + resp, len(prompt)


def train(model: LlamaForCausalLM, tokenizer: Any, steps: int, batch_size: int, lr: float) -> float:
    """Warm-start `model` in place on the data mix; returns the mean loss of the last 50 steps."""
    rng = random.Random(SEED + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for step in range(steps):
        examples = [encode_example(tokenizer, *training_example(rng)) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in examples)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for b, (seq, start) in enumerate(examples):
            ids[b, : len(seq)] = torch.tensor(seq)
            labels[b, start : len(seq)] = torch.tensor(seq[start:])
            mask[b, : len(seq)] = 1
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return sum(losses[-50:]) / len(losses[-50:])


@torch.no_grad()
def complete(
    model: LlamaForCausalLM,
    tokenizer: Any,
    chats: list[list[dict[str, str]]],
    greedy: bool = True,
    seed: int = 0,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
) -> list[str]:
    """Decode one completion per chat (greedy, or sampling at `temperature` with `seed`)."""
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for c in chats
    ]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling: dict[str, Any] = (
        {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}  # 0: off
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(  # type: ignore[misc]  # transformers types `self` as a protocol
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def hint_accuracy(
    model: LlamaForCausalLM,
    tokenizer: Any,
    task: Task,
    problems: list[Problem],
    greedy: bool = True,
    seed: int = 0,
    temperature: float = 1.0,
) -> tuple[float, float]:
    """(plain, hinted) accuracy: the hint is the verifier's hint for the model's own plain
    completion, or for `wrong_guess` when that completion was right."""
    msgs = [p["messages"] for p in problems]
    plain = complete(model, tokenizer, msgs, greedy, seed, temperature=temperature)
    hints = [
        task.verify(p, c).hint or task.verify(p, wrong_guess(p)).hint
        for p, c in zip(problems, plain, strict=True)
    ]
    # (a wrong answer always gets a hint)
    chats = [hinted_messages(p, cast(str, h)) for p, h in zip(problems, hints, strict=True)]
    hinted = complete(model, tokenizer, chats, greedy, seed + 1, temperature=temperature)

    def acc(outs: list[str]) -> float:
        return sum(
            task.verify(p, o).reward == 1.0 for p, o in zip(problems, outs, strict=True)
        ) / len(outs)

    return acc(plain), acc(hinted)


def build(out: str | Path, steps: int = 1500, batch_size: int = 48, lr: float = 2e-3) -> dict:
    """Build the tiny policy into `out` (replaced) and return the build info it records."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    start = time.perf_counter()
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=512)
    config = tiny_llama_config(
        len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
        final_loss = train(model, tokenizer, steps, batch_size, lr)
    info: dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": SEED,
        "final_loss": round(final_loss, 4),
    }
    for task in (Arithmetic(), ReverseDigits()):
        problems = task.samples(200, seed=1234)
        for mode, greedy in (("greedy", True), ("sampled_t1", False)):
            plain, hinted = hint_accuracy(model, tokenizer, task, problems, greedy, seed=7)
            info[f"{task.name}/{mode}/plain_accuracy"] = plain
            info[f"{task.name}/{mode}/hinted_accuracy"] = hinted
    # Carries, the policy's weak spot (it "forgets" them), greedy and sampled at 0.6 and 1.
    carry = Arithmetic(carry_only=True)
    problems = carry.samples(300, seed=1234)
    for mode, greedy, temperature in (
        ("greedy", True, 1.0),
        ("sampled_t0.6", False, 0.6),
        ("sampled_t1", False, 1.0),
    ):
        plain, hinted = hint_accuracy(model, tokenizer, carry, problems, greedy, 7, temperature)
        info[f"arithmetic_carry/{mode}/plain_accuracy"] = plain
        info[f"arithmetic_carry/{mode}/hinted_accuracy"] = hinted
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=16,
    ).save_pretrained(str(out))
    (out / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    write_checksums(out)
    info["build_seconds"] = round(time.perf_counter() - start, 1)  # not written: not deterministic
    return info


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m composer_lightning.assets.build_tiny --out DIR [--steps N]`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (replaced)")
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, steps=args.steps), indent=2))


if __name__ == "__main__":
    main()

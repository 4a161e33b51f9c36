"""Build the shipped tiny tool policy offline: tokenizer, Llama, warm start, episodes, checksums.

Rebuild (deterministic on the same software stack)::

    OMP_NUM_THREADS=1 python -m composer_lightning.assets.build_tiny_tool \
        --out composer_lightning/assets/tiny_tool_policy

The policy plays `ToolCalc` episodes (a + b, 10–999, with the tool `add(a: int, b: int)`). Its
warm start (a plain torch loop, 1 thread, seed 0) clones a scripted policy that calls the tool,
sometimes wrongly:
- turn 1: a good call `<tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>`,
  except, systematically, on the "Let x = A and y = B" phrasing it mostly names the arguments
  `x` and `y` (`P_XY_ERROR`), and on the plain phrasing it sometimes writes a Python-style call
  `<tool_call>add(a=A, b=B)</tool_call>` (`P_FORMAT_ERROR`), which is not JSON;
- after a tool error with no hint, it repeats its mistake (`P_REPEAT`), else calls well;
- with a hint in context (the tool's error text as an extra `user` message right before the
  assistant turn: after the tool message, or — the teacher's context of the erroneous turn —
  right after the problem), it calls well;
- after a tool result R it answers "The answer is R.".
The measured episode figures (greedy and sampled, without and with the error-derived hint) are
written to `build_info.json`. Simplified on purpose: one fixed data mix, no validation split.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from composer_lightning.envs.python_tools import CALL_CLOSE, CALL_OPEN, PythonToolEnv
from composer_lightning.models.tiny import tiny_llama_config, train_tokenizer, write_checksums
from composer_lightning.tasks.tool_calc import ToolCalc, add

SEED = 0
P_XY_ERROR, P_FORMAT_ERROR, P_REPEAT = 0.9, 0.2, 0.85
#: Of the warm-start episodes: hinted after each error, and hinted before the first turn.
P_HINT_AFTER, P_HINT_BEFORE = 0.35, 0.2
MAX_TURNS, MAX_NEW_TOKENS, EVAL_EPISODES = 3, 48, 200

#: The tiny policy's template with the tools first, as one compact system turn of signatures
#: (`add(a: int, b: int)`, as `signature_text` writes them). Every turn starts and ends with a
#: special token, so rendering stays prefix-stable; an assistant turn is
#: `<|assistant|>content<|eot|>` and the generation prompt is `<|assistant|>`.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set py = {'integer': 'int', 'number': 'float', 'string': 'str', 'boolean': 'bool',"
    " 'array': 'list', 'object': 'dict'} %}"
    "{% if tools %}<|system|>Tools:"
    "{% for t in tools %}{% set f = t['function'] if 'function' in t else t %}"
    " {{ f['name'] }}("
    "{% for k, v in f['parameters']['properties'].items() %}"
    "{{ k }}: {{ py.get(v['type'], v['type']) }}{{ ', ' if not loop.last }}"
    "{% endfor %}){{ ';' if not loop.last }}"
    "{% endfor %}<|eot|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] if m['content'] is not none else '' }}<|eot|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _json_call(arguments: dict[str, int]) -> str:
    return CALL_OPEN + json.dumps({"name": "add", "arguments": arguments}) + CALL_CLOSE


def good_call(a: int, b: int) -> str:
    """The correct call of `add` on `a`, `b`."""
    return _json_call({"a": a, "b": b})


def bad_call(problem: dict[str, Any]) -> str:
    """The policy's systematic mistake on `problem`: `x`/`y` argument names on the x/y
    phrasing, a Python-style (not JSON) call on the plain one."""
    a, b = problem["a"], problem["b"]
    if problem["phrasing"] == 1:
        return _json_call({"x": a, "y": b})
    return f"<tool_call>add(a={a}, b={b})</tool_call>"


def answer_text(result: str) -> str:
    """The final answer after the tool's result (the verifier reads its last integer)."""
    return f"The answer is {result}."


def scripted_episode(problem: dict[str, Any], rng: random.Random) -> list[dict[str, str]]:
    """One warm-start episode of the scripted policy on `problem` (the chat after the tools)."""
    env = PythonToolEnv([add], timeout=None)
    messages = env.reset(problem)
    mode = rng.random()
    hint_after, hint_before = mode < P_HINT_AFTER, mode > 1 - P_HINT_BEFORE
    wrong = rng.random() < (P_XY_ERROR if problem["phrasing"] == 1 else P_FORMAT_ERROR)
    if hint_before:
        err = env.step({"role": "assistant", "content": bad_call(problem)}).tool_error
        messages.append({"role": "user", "content": str(err)})
        wrong = False
    for _ in range(3):  # at most two errors, then a good call
        call = bad_call(problem) if wrong else good_call(problem["a"], problem["b"])
        messages.append({"role": "assistant", "content": call})
        obs = env.step(messages[-1])
        messages.extend(obs.messages)
        if obs.tool_error is None:
            break
        if hint_after:
            messages.append({"role": "user", "content": obs.tool_error})
        wrong = not hint_after and rng.random() < P_REPEAT
    else:
        return messages
    messages.append({"role": "assistant", "content": answer_text(messages[-1]["content"])})
    return messages


def warm_start_episode(rng: random.Random) -> list[dict[str, str]]:
    """A fresh problem of the default `ToolCalc()` and the scripted policy's episode on it."""
    return scripted_episode(ToolCalc().sample(rng), rng)


def encode_episode(
    tokenizer: Any, messages: list[dict[str, str]], tools: list[dict]
) -> tuple[list[int], list[bool]]:
    """(ids of the whole episode, loss mask: True on assistant content and its `<|eot|>`),
    rendered turn by turn (the template is prefix-stable)."""
    ids: list[int] = []
    mask: list[bool] = []
    for k, m in enumerate(messages):
        text = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert full[: len(ids)] == ids, "the template is not prefix-stable"
        new = full[len(ids) :]
        ids += new
        mask += [m["role"] == "assistant" and i > 0 for i in range(len(new))]
    return ids, mask


def tokenizer_corpus(n: int = 3000) -> list[str]:
    """Message texts of warm-start episodes, and the tool system line."""
    rng = random.Random(SEED)
    texts = ["Tools: add(a: int, b: int)"]
    for _ in range(n):
        texts.extend(m["content"] for m in warm_start_episode(rng))
    return texts


def train(model: LlamaForCausalLM, tokenizer: Any, steps: int, batch_size: int, lr: float) -> float:
    """Warm-start `model` in place; returns the mean loss of the last 50 steps."""
    rng = random.Random(SEED + 1)
    tools = PythonToolEnv([add]).tools
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for step in range(steps):
        examples = [
            encode_episode(tokenizer, warm_start_episode(rng), tools) for _ in range(batch_size)
        ]
        width = max(len(ids) for ids, _ in examples)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attn = torch.zeros((batch_size, width), dtype=torch.long)
        for b, (seq, keep) in enumerate(examples):
            ids[b, : len(seq)] = torch.tensor(seq)
            labels[b, : len(seq)] = torch.where(torch.tensor(keep), torch.tensor(seq), -100)
            attn[b, : len(seq)] = 1
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return sum(losses[-50:]) / len(losses[-50:])


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    tokenizer: Any,
    chats: list[list[dict[str, str]]],
    tools: list[dict],
    greedy: bool = True,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[str]:
    """One assistant message per chat (greedy, or sampled at `temperature` with `seed`), each
    stopped at the eos `<|eot|>`."""
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                c, tools=tools, tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for c in chats
    ]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling: dict[str, Any] = (
        {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(  # type: ignore[misc]  # transformers types `self` as a protocol
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=not greedy,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def run_episodes(
    model: LlamaForCausalLM,
    tokenizer: Any,
    problems: list[dict[str, Any]],
    hinted: bool = False,
    greedy: bool = True,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[dict[str, Any]]:
    """Play one episode per problem against the real `PythonToolEnv` (at most `MAX_TURNS`
    assistant turns). `hinted`: after a tool error, its text is appended as a `user` message
    before the next turn. Returns per episode `success` (the verifier's reward is 1.0 on the
    final answer), `errors` (the `tool_error` of each call) and `chat`."""
    task = ToolCalc()
    envs = [task.environment(p) for p in problems]
    chats = [env.reset(p) for env, p in zip(envs, problems, strict=True)]
    records: list[dict[str, Any]] = [{"success": False, "errors": []} for _ in problems]
    active = list(range(len(problems)))
    for turn in range(MAX_TURNS):
        if not active:
            break
        texts = generate(
            model,
            tokenizer,
            [chats[i] for i in active],
            envs[0].tools,
            greedy,
            seed + turn,
            temperature,
        )
        still = []
        for i, text in zip(active, texts, strict=True):
            message = {"role": "assistant", "content": text}
            obs = envs[i].step(message)
            chats[i] += [message, *obs.messages]
            if obs.done and not obs.messages:  # a final answer
                records[i]["success"] = task.verify(problems[i], text).reward == 1.0
                continue
            records[i]["errors"].append(obs.tool_error)
            if not obs.done:
                if hinted and obs.tool_error is not None:
                    chats[i].append({"role": "user", "content": obs.tool_error})
                still.append(i)
        active = still
    for record, chat in zip(records, chats, strict=True):
        record["chat"] = chat
    return records


def episode_figures(
    model: LlamaForCausalLM,
    tokenizer: Any,
    problems: list[dict[str, Any]],
    greedy: bool,
    seed: int,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Success without and with the error-derived hint, the first-call error rate, how often
    the call after a first error is good (unhinted, hinted), and the hinted recovery rate: of
    the first calls that failed, the share that comes out good when that turn is redone with
    its error as a hint (the teacher's context: the problem, the hint, the assistant turn)."""
    plain = run_episodes(model, tokenizer, problems, False, greedy, seed, temperature)
    hinted = run_episodes(model, tokenizer, problems, True, greedy, seed, temperature)
    failed = [i for i, r in enumerate(plain) if r["errors"] and r["errors"][0] is not None]
    env = ToolCalc().environment(problems[0])
    chats = [
        [*problems[i]["messages"], {"role": "user", "content": plain[i]["errors"][0]}]
        for i in failed
    ]
    redone = generate(model, tokenizer, chats, env.tools, greedy, seed + 100, temperature)
    recovered = [env.step({"role": "assistant", "content": t}).tool_error is None for t in redone]

    def retry_rate(records: list[dict[str, Any]]) -> float:
        seconds = [r["errors"][1] is None if len(r["errors"]) > 1 else False for r in records]
        return sum(seconds[i] for i in failed) / max(1, len(failed))

    n = len(problems)
    return {
        "plain/success": sum(r["success"] for r in plain) / n,
        "hinted/success": sum(r["success"] for r in hinted) / n,
        "first_call_error_rate": len(failed) / n,
        "plain/retry_good_call_rate": retry_rate(plain),
        "hinted/retry_good_call_rate": retry_rate(hinted),
        "hinted_recovery_rate": sum(recovered) / max(1, len(recovered)),
    }


def build(out: str | Path, steps: int = 300, batch_size: int = 32, lr: float = 2e-3) -> dict:
    """Build the tiny tool policy into `out` (replaced) and return the build info it records."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    start = time.perf_counter()
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=512, split_words=False)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    config = tiny_llama_config(
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        max_position_embeddings=512,
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
        "episodes": EVAL_EPISODES,
        "max_turns": MAX_TURNS,
    }
    problems = ToolCalc().samples(EVAL_EPISODES, seed=1234)
    for mode, greedy, temperature in (
        ("greedy", True, 1.0),
        ("sampled_t1", False, 1.0),
        ("sampled_t0.7", False, 0.7),
    ):
        figures = episode_figures(model, tokenizer, problems, greedy, 7, temperature)
        info.update({f"tool_calc/{mode}/{k}": round(v, 4) for k, v in figures.items()})
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
    ).save_pretrained(str(out))
    (out / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    write_checksums(out)
    info["build_seconds"] = round(time.perf_counter() - start, 1)  # not written: not deterministic
    return info


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m composer_lightning.assets.build_tiny_tool --out DIR [--steps N]`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (replaced)")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, steps=args.steps), indent=2))


if __name__ == "__main__":
    main()

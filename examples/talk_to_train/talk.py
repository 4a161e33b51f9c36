"""Train the tiny policy by talking to it, through its OpenAI-compatible endpoint.

    python examples/talk_to_train/talk.py                 # starts the server itself
    python examples/talk_to_train/talk.py --url http://127.0.0.1:8000/v1   # a running one
    # SmolLM2 on vLLM, asked chat sums checked on the reply's final number:
    python examples/talk_to_train/talk.py --config configs/serve_smollm2_cpu.yaml \
        --task chat_arithmetic

Scripted users (two by default, `--users`) ask arithmetic questions in concurrent sessions.
Each answer gets a reply, the answer's *next state*, as a person would write it: "Correct."
when it is right, "No, that is wrong. Hint: ..." (the verifier's hint, or with `--correction
answer` the right answer) when it is not — and, now and then, only a hint or only "Ok." —
then the session ends. The server judges each answer with that reply (`FeedbackScore`,
`FeedbackHint`), trains on every `batch_size` judged answers and pushes the weights into the
engine it serves from. Before and after, greedy answers to held-out questions are scored
(temperature 0: served, not trained on). Prints one JSON line of figures at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from composer_lightning.rollout.validation import is_heldout  # noqa: E402
from composer_lightning.tasks.registry import get_task  # noqa: E402

MODEL = "policy"
TASK = {"name": "arithmetic"}  # the task whose questions the users ask (`--task`)
CORRECTION = {"kind": "hint"}  # what a user's "No" says besides (`--correction`)


def the_task():
    """The task the users ask and check (`--task`)."""
    return get_task(TASK["name"])


def version(response) -> int:
    """The served weight version (`system_fingerprint` is `weights-l<launch>-v<N>`)."""
    return int(re.search(r"v(\d+)", response.system_fingerprint or "v0").group(1))


def ask(client, messages, session, done=False, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        extra_body={"session_id": session, "session_done": done},
        **kwargs,
    )


def accuracy(client, problems, session="eval") -> float:
    """Greedy answers to `problems`, scored by the task's verifier."""
    task, right = the_task(), 0
    for i, p in enumerate(problems):
        r = ask(client, p["messages"], f"{session}-{i}", done=True, temperature=0.0)
        right += task.verify(p, r.choices[0].message.content or "").reward == 1.0
    return right / len(problems)


def reply(problem, answer: str, n: int) -> str:
    """The user's reply to `answer`: its next state (four kinds, as people write them). A
    wrong answer's correction is the verifier's hint ("The answer has 2 digits; ..."), or with
    `--correction answer` the right answer ("The correct answer is 42.")."""
    verdict = the_task().verify(problem, answer)
    if verdict.reward == 1.0:
        return "Ok." if n % 5 == 4 else "Correct, thanks."
    hint = verdict.hint
    if CORRECTION["kind"] == "answer":  # a user who knows the answer and says it
        hint = f"The correct answer is {problem['answer']}."
    if n % 4 == 3:
        return f"Hint: {hint}"
    return f"No, that is wrong. Hint: {hint}"


def user(client, name: str, seed: int, until: int, log: list) -> None:
    """One scripted user: sessions of one question, its answer, the reply, until the served
    weights reach version `until`."""
    rng, task, n = random.Random(seed), the_task(), 0
    while True:
        problem = task.sample(rng)
        if is_heldout(problem, 0.2):
            continue
        session = f"{name}-{n}"
        first = ask(client, problem["messages"], session)
        answer = first.choices[0].message.content or ""
        follow = [
            *problem["messages"],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": reply(problem, answer, n)},
        ]
        ask(client, follow, session, done=True, max_tokens=4)
        log.append((name, task.verify(problem, answer).reward, version(first)))
        n += 1
        if version(first) >= until or n >= 50 * until:  # bounded, should training stall
            return


def start_server(workdir: str, extra: list[str], config: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "composer_lightning", "serve", "--config", config,
        f"--trainer.default_root_dir={workdir}",
        f"--trainer.logger.init_args.save_dir={workdir}",
        f"--rollout.init_args.store={workdir}/turns.sqlite", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
    )  # fmt: skip
    for line in proc.stdout:
        print(line, end="", flush=True)
        m = re.search(r"serving .* at (http://\S+)", line)
        if m:
            threading.Thread(
                target=lambda: [print(x, end="") for x in proc.stdout], daemon=True
            ).start()
            return proc, m.group(1)
    raise RuntimeError(f"the server exited ({proc.wait()}) before it printed its address")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server's base URL (…/v1)")
    ap.add_argument("--steps", type=int, default=30, help="training steps to talk for")
    ap.add_argument("--heldout", type=int, default=64, help="held-out questions scored")
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve arguments")
    ap.add_argument(
        "--config", default=str(ROOT / "configs" / "serve_cpu.yaml"), help="the server's config"
    )
    ap.add_argument(
        "--task", default="arithmetic",
        help="the task the users ask and check (chat_arithmetic for a real chat model: "
        "checked on the reply's final number)",
    )  # fmt: skip
    ap.add_argument(
        "--correction", choices=("hint", "answer"), default="hint",
        help="what a user says after 'No, that is wrong.': the verifier's hint, or the answer",
    )  # fmt: skip
    ap.add_argument("--users", type=int, default=2, help="concurrent scripted users")
    args = ap.parse_args(argv)
    if args.users < 1:
        raise SystemExit(f"--users must be >= 1, got {args.users}")
    TASK["name"], CORRECTION["kind"] = args.task, args.correction
    import openai

    proc, tmp = None, None
    url = args.url
    if url is None:
        tmp = tempfile.mkdtemp(prefix="talk_to_train_")
        proc, url = start_server(tmp, args.server_arg, args.config)
    client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    try:
        rng, task, held = random.Random(123), the_task(), []
        while len(held) < args.heldout:
            p = task.sample(rng)
            if is_heldout(p, 0.2) and p["messages"] not in [h["messages"] for h in held]:
                held.append(p)
        before = accuracy(client, held)
        log: list = []
        users = [
            threading.Thread(target=user, args=(client, f"user{k}", k, args.steps, log))
            for k in range(args.users)
        ]
        for t in users:
            t.start()
        for t in users:
            t.join()
        after = accuracy(client, held, session="eval-after")
        by_version: dict = defaultdict(list)
        for _, reward, v in log:
            by_version[v].append(reward == 1.0)
        figures = {
            "heldout_before": before,
            "heldout_after": after,
            "served_right_by_version": {
                v: round(sum(r) / len(r), 3) for v, r in sorted(by_version.items())
            },
            "sessions": len(log),
            "versions_seen": sorted({v for *_, v in log}),
            "url": url,
        }
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # drains, saves, exits
            figures_code = proc.wait(timeout=120)
            print(f"server exited with {figures_code}", flush=True)
    figures["server_exit"] = None if proc is None else figures_code
    figures["workdir"] = tmp
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    main()

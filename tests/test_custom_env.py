"""`examples/custom_env`: a user's own stateful environment with two tools, tested as a user
writes and runs it — the environment on a scripted episode, and its config trained from
another working directory with the example on `PYTHONPATH`."""

from __future__ import annotations

import glob
import shutil
import sys

import pytest

from composer_lightning.models.tiny import tiny_tool_policy_path
from tests.helpers import ROOT, run_cli

EXAMPLE = ROOT / "examples" / "custom_env"


@pytest.fixture()
def bank_env(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import bank_env

    yield bank_env
    sys.modules.pop("bank_env", None)


def _call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_scripted_episode_keeps_the_account_and_decides_the_outcome(bank_env):
    """120, deposit 35 and 17: a bad deposit is the turn's tool error (the account unchanged),
    two calls in one message both run (tool messages in order, with their call ids), the
    answer 172 with both deposits made scores 1; the same answer without them scores 0."""
    problem = {"messages": [{"role": "user", "content": "..."}], "start": 120, "deposits": [35, 17]}
    env = bank_env.BankTask().environment(problem)
    assert env.reset(problem) == problem["messages"] and env.tools == bank_env.TOOLS
    bad = env.step({"role": "assistant", "content": _call("deposit", amount=-5)})
    assert bad.tool_error == "deposit: amount must be a positive whole number, got -5."
    assert env.balance == 120 and not bad.done
    both = env.step(
        {"role": "assistant", "content": _call("deposit", amount=35) + _call("deposit", amount=17)}
    )
    assert [m["content"] for m in both.messages] == ["155", "172"] and both.tool_error is None
    assert len({m["tool_call_id"] for m in both.messages}) == 2
    assert (
        env.step({"role": "assistant", "content": _call("balance")}).messages[0]["content"] == "172"
    )
    end = env.step({"role": "assistant", "content": "The balance is 172."})
    assert (end.done, end.reward) == (True, 1.0)
    lazy = bank_env.BankEnv()
    lazy.reset(problem)
    assert lazy.step({"role": "assistant", "content": "It is 172."}).reward == 0.0  # no deposits
    unknown = lazy.step({"role": "assistant", "content": _call("withdraw", amount=3)})
    assert unknown.tool_error.startswith("Tool call error: unknown tool 'withdraw'")


def train_example_elsewhere(example, run_name: str, tmp_path) -> dict:
    """An example directory copied elsewhere and its config trained as its README says, for 2
    steps with the HF engine: checks held-out episode success before the first step and after
    it, 2 training losses; returns the first episode written to `rollouts.jsonl`."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    work = tmp_path / "mine"
    shutil.copytree(example, work)
    out = run_cli(
        "fit", "--config", "config.yaml",
        "--rollout.engine.class_path=composer_lightning.engines.HFEngine",
        f"--model.policy={tiny_tool_policy_path()}",
        "--trainer.max_steps=2", "--trainer.val_check_interval=2",
        "--data.init_args.val_prompts=4", "--rollout.init_args.samples_every_n_steps=1",
        pythonpath=str(work), cwd=work,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = work / "runs" / run_name / "version_0"
    (events,) = glob.glob(str(run / "events.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/accuracy")] == [0, 1]  # before, and after step 2
    assert len(acc.Scalars("train/loss")) == 2
    return json.loads((run / "rollouts.jsonl").read_text().splitlines()[0])


@pytest.mark.slow  # a fit through the command line
def test_the_examples_config_trains_from_another_directory(tmp_path):
    """Copied elsewhere, run as the README says: held-out episode success before the first step
    and after it, the environment's tools in the rollouts written."""
    episode = train_example_elsewhere(EXAMPLE, "custom_env", tmp_path)
    assert episode["tools"] == _tools() and episode["messages"][0]["role"] == "user"


def _tools():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import bank_env

        return bank_env.TOOLS
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("bank_env", None)

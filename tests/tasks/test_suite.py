"""The sparse-reward suite's definition: figures recorded, thresholds met, the bench's output
the same figures, every task buildable with a held-out set; and one cheap greedy check on the
shipped policy (the full re-measurement is `bench/sparse_suite.py`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from composer_lightning.assets.build_tiny import hint_accuracy
from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.tasks.suite import (
    FIGURES,
    MAX_PLAIN_SAMPLED,
    MIN_HINTED_SAMPLED,
    PROBLEM_SEED,
    PROBLEMS,
    SAMPLE_SEED,
    SUITE,
)

ROOT = Path(__file__).resolve().parents[2]


def test_suite_has_three_kinds_each_sparse_alone_and_helped_by_the_hint() -> None:
    assert len(SUITE) >= 3
    assert len({e.kind for e in SUITE.values()}) == len(SUITE)
    assert PROBLEMS >= 200
    for name, entry in SUITE.items():
        f = entry.figures
        assert set(f) == set(FIGURES), name
        assert all(math.isfinite(v) for v in f.values()), name
        assert all(0.0 <= f[k] <= 1.0 for k in FIGURES if "rank" not in k), name
        assert f["plain_sampled"] <= MAX_PLAIN_SAMPLED, name
        assert f["hinted_sampled"] >= MIN_HINTED_SAMPLED, name
        assert f["hardest_prob_mean"] <= f["first_prob_mean"], name  # a min over the tokens
        assert 0 < entry.temperature <= 1.0, name
    # at least one task whose right first token is far down the plain policy's distribution
    assert any(
        e.figures["first_rank_median"] >= 3 and e.figures["first_prob_median"] < 1e-3
        for e in SUITE.values()
    )


def test_the_bench_output_records_the_same_suite() -> None:
    data = json.loads((ROOT / "docs" / "sparse_suite.json").read_text())
    assert (data["problems"], data["problem_seed"], data["sample_seed"]) == (
        PROBLEMS,
        PROBLEM_SEED,
        SAMPLE_SEED,
    )
    assert set(data["tasks"]) == set(SUITE)
    for name, entry in SUITE.items():
        recorded = data["tasks"][name]
        assert recorded["task"] == entry.task and recorded["task_args"] == entry.task_args
        assert recorded["temperature"] == entry.temperature and recorded["kind"] == entry.kind
        assert recorded["figures"] == pytest.approx(entry.figures, rel=1e-9), name


@pytest.mark.parametrize("name", list(SUITE))
def test_task_builds_verifies_hints_and_has_a_held_out_set(name: str) -> None:
    entry = SUITE[name]
    task = entry.build()
    for problem in task.samples(20, seed=0):
        assert task.verify(problem, str(problem["answer"])).reward == 1.0
        verdict = task.verify(problem, str(int(problem["answer"]) + 1))
        assert verdict.reward == 0.0 and isinstance(verdict.hint, str)
    args = dict(a.split("=", 1) for a in (s.removeprefix("--") for s in entry.fit_args()))
    dm = RolloutDataModule(
        task=args["data.init_args.task"],
        task_args=json.loads(args["data.init_args.task_args"]),
    )
    assert len(dm.validation_problems()) >= 16
    assert float(args["rollout.sampling.temperature"]) == entry.temperature


def test_greedy_figures_hold_on_the_first_problems(tiny_policy) -> None:
    """Greedy decoding of the first 32 problems of each task (a prefix of the measured set):
    the plain policy solves none (every task's recorded plain greedy accuracy is 0) and the
    hint in context solves a clear share."""
    model, tokenizer = tiny_policy
    for name, entry in SUITE.items():
        task = entry.build()
        problems = task.samples(32, seed=PROBLEM_SEED)
        plain, hinted = hint_accuracy(model, tokenizer, task, problems, True, SAMPLE_SEED)
        assert plain <= entry.figures["plain_greedy"] + 1 / 32, name
        assert hinted >= entry.figures["hinted_greedy"] / 2, name


@pytest.fixture(scope="module")
def tiny_policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_lightning.models.tiny import tiny_policy_path

    path = tiny_policy_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)

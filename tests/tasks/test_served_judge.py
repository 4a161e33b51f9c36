"""The LLM judge against a real OpenAI-compatible server: vLLM's own server of the tiny policy on
CPU (`VLLMServer`), started on a free local port for this module and stopped after it."""

from __future__ import annotations

import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, OpenAIEngine, SamplingConfig
from composer_lightning.engines.vllm_server import VLLMServer
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.tasks import Arithmetic, LLMJudgeScore, VerifierHint
from composer_lightning.training.module import ComposerModule
from tests.helpers import quiet_trainer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM server per test


@pytest.fixture(scope="module")
def server():
    """vLLM's own OpenAI server, as `VLLMServer` starts it (the command that works on CPU)."""
    with VLLMServer(tiny_policy_path(), name="tiny-judge", threads=1, max_model_len=256) as s:
        yield s.url


def test_served_judge_votes_through_a_real_server(server) -> None:
    engine = OpenAIEngine(server)  # the model name is read from the server
    replies = engine.chat(
        [[{"role": "user", "content": "What is 2 + 3?"}]] * 2,
        3,
        SamplingConfig(max_tokens=8, seed=0),
    )
    assert engine.model == "tiny-judge"
    assert [len(r) for r in replies] == [3, 3]
    assert all(
        isinstance(c.text, str) and c.finish_reason in ("stop", "length")
        for r in replies
        for c in r
    )

    class Recording(OpenAIEngine):
        def chat(self, conversations, n, sampling):
            self.replies = super().chat(conversations, n, sampling)
            return self.replies

    recording = Recording(server)
    judge = LLMJudgeScore(recording, votes=3, sampling=SamplingConfig(max_tokens=1, seed=1))
    problems = [Arithmetic().make(2, "+", 3), Arithmetic().make(4, "+", 4)]
    scores = judge.score(problems, ["5", "9"])
    assert len(scores) == 2 and all(s in (None, 0.0, 1.0) for s in scores)
    assert judge.failures == 0
    cut = sum(c.finish_reason == "length" for r in recording.replies for c in r)
    assert judge.truncated == cut >= 3  # one token: most votes are cut off by max_tokens


def test_one_failing_request_fails_only_its_own_sample(server) -> None:
    """A prompt past the server's context (256 tokens) is refused: that sample gets no vote and
    one failure is counted; the other sample of the same call is judged."""
    judge = LLMJudgeScore(OpenAIEngine(server), votes=2, sampling=SamplingConfig(max_tokens=2))
    long = Arithmetic().make(2, "+", 3)
    long["messages"] = [{"role": "user", "content": "What is 2 + 3? " * 200}]
    scores = judge.score([Arithmetic().make(4, "+", 4), long], ["8", "5"])
    assert judge.failures == 1 and scores[1] is None
    assert scores[0] in (None, 0.0, 1.0)  # judged (its votes may not agree)
    too_long = [[{"role": "user", "content": "x " * 400}]]
    assert judge.engine.chat(too_long, 1, judge.sampling) == [[]]  # no replies, no exception


def test_a_rollout_step_with_a_served_judge_logs_truncated_votes(server) -> None:
    policy = tiny_policy_path()
    judge = LLMJudgeScore(OpenAIEngine(server), votes=3, sampling=SamplingConfig(max_tokens=4))
    callback = RolloutCallback(
        HFEngine(seed=0),
        group_size=2,
        score=judge,
        hint=VerifierHint(),
        hint_trust="always",  # votes cut at 4 tokens may score nothing: the hints carry the step
        sampling=SamplingConfig(max_tokens=6, seed=0),
        samples_every_n_steps=0,
    )
    module = ComposerModule(
        policy, [DrGRPOHead(), OPDHead()], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4)
    )
    trainer = quiet_trainer(
        max_steps=1,
        callbacks=[callback],
    )
    trainer.fit(module, RolloutDataModule(prompts_per_step=2))
    metrics = trainer.callback_metrics
    # 3 votes on each of the 4 rollouts, and on the hint check's two greedy replies (hinted
    # teacher, student) of each of the 2 groups with a hint
    assert 0 <= float(metrics["rollout/judge_truncated"]) <= (2 * 2 + 2 * 2) * 3
    assert float(metrics["rollout/score_failures"]) == 0

"""The rollout side with a real engine (HF `generate`): datamodule, callback, dispatch, canary."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from composer_lightning.datamodules.rollout import RolloutDataModule
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.schedules import LinearRamp
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback
from composer_lightning.tasks import FunctionScore, ScoringError, VerifierHint
from composer_lightning.training.module import ComposerModule, OutOfSyncError
from tests.helpers import quiet_trainer

POLICY = tiny_policy_path()


def _fit(callbacks, steps=3, heads=None, lr=1e-3, **dm_kw):
    module = ComposerModule(
        POLICY, heads or [DrGRPOHead(), OPDHead()], optimizer=lambda p: torch.optim.AdamW(p, lr=lr)
    )
    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=4, **dm_kw)
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=callbacks,
    )
    trainer.fit(module, dm)
    return module, dm, trainer


class Watch(L.Callback):
    """Records, at each step, whether the engine's weights equal the policy's."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        same = all(
            torch.equal(p, self.engine._params[n]) for n, p in module.policy.named_parameters()
        )
        self.seen.append((batch_idx, batch.rollout.policy_version, module.policy_version, same))


def _callback(**kw):
    engine = HFEngine(model_path=POLICY, seed=0)
    kw.setdefault("hint", VerifierHint())
    return RolloutCallback(
        engine, group_size=2, sampling=SamplingConfig(max_tokens=6, seed=0), **kw
    )


def test_step_k_trains_on_rollouts_of_the_weights_after_update_k_minus_1():
    cb = _callback()
    watch = Watch(cb.engine)
    module, dm, trainer = _fit([cb, watch], steps=4, lr=1e-2)
    assert [s[:3] for s in watch.seen] == [(k, k, k) for k in range(4)]
    assert all(s[3] for s in watch.seen)  # engine weights == policy weights when generating
    assert cb.engine.weight_version == module.policy_version == 4
    assert float(trainer.callback_metrics["rollout/logprob_gap_mean"]) < 1e-5
    assert dm.consumed == 4
    for key in (
        "rollout/reward_mean",
        "rollout/reward_std",
        "rollout/response_length_mean",
        "rollout/response_length_max",
        "rollout/truncation_rate",
        "rollout/gen_time",
        "rollout/push_time",
        "rollout/tokens_per_s",
        "dispatch/opd_rl",
        "dispatch/rl_only",
        "dispatch/opd_only",
        "dispatch/dropped",
    ):
        assert key in trainer.callback_metrics, key


class NoPush(RolloutCallback):
    """An engine that never receives weights after the first sync (a broken push)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.engine._version = pl_module.policy_version  # claims the version, keeps old weights


def test_a_stale_engine_trips_the_canary():
    engine = HFEngine(model_path=POLICY, seed=0)
    cb = NoPush(
        engine, group_size=2, sampling=SamplingConfig(max_tokens=6, seed=0), hint=VerifierHint()
    )
    with pytest.raises(OutOfSyncError, match="engine is out of sync"):
        _fit([cb], steps=6, lr=0.05)


def test_a_raising_reward_function_drops_and_counts_the_sample():
    calls = {"n": 0}

    def flaky(problem, completion):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("reward function failed")
        return 1.0

    cb = _callback(score=FunctionScore(flaky), hint=None)
    _, _, trainer = _fit([cb], steps=1)
    assert float(trainer.callback_metrics["dispatch/dropped"]) == 4  # half of 4 prompts x G = 2
    assert float(trainer.callback_metrics["rollout/score_failures"]) == 4


def test_all_scores_failing_is_a_clear_error():
    def broken(problem, completion):
        raise RuntimeError("boom")

    with pytest.raises(ScoringError, match="all 8 score calls of the batch raised"):
        _fit([_callback(score=FunctionScore(broken), hint=None)], steps=1)


def test_the_module_follows_the_sampling_temperature():
    """One place sets the temperature: the module's log-probs are taken at the sampler's, so
    the canary agrees with the engine at 0.7 (at 1.0 the log-probs would differ by far more)."""
    engine = HFEngine(model_path=POLICY, seed=0)
    cb = RolloutCallback(
        engine, group_size=2, sampling=SamplingConfig(temperature=0.7, max_tokens=6, seed=0)
    )
    module, _, trainer = _fit([cb], steps=1)
    assert module.temperature == 0.7 and module.configured_temperature is None
    assert float(trainer.callback_metrics["rollout/logprob_gap_mean"]) < 1e-5


def test_temperature_mismatch_is_refused():
    engine = HFEngine(model_path=POLICY)
    cb = RolloutCallback(engine, sampling=SamplingConfig(temperature=0.7))
    module = ComposerModule(POLICY, [DrGRPOHead()], temperature=1.0)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[cb])
    with pytest.raises(ValueError, match=r"model.temperature \(1.0\) differs from rollout"):
        trainer.fit(module, RolloutDataModule(tokenizer=POLICY, prompts_per_step=4))


def test_prompt_file_errors_name_file_and_line(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "1+2=", "answer": 3}) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2: not valid JSON"):
        RolloutDataModule(tokenizer=POLICY, prompt_file=str(good))
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:1: needs 'prompt'"):
        RolloutDataModule(tokenizer=POLICY, prompt_file=str(bad))
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        RolloutDataModule(tokenizer=POLICY, prompt_file=str(empty))


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match="arithmetic"):
        RolloutDataModule(tokenizer=POLICY, task="chess")


def test_prompt_stream_is_sharded_deterministic_and_resumable(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(10))
    )
    dm = RolloutDataModule(
        tokenizer=POLICY, prompt_file=str(f), task="arithmetic", prompts_per_step=3
    )

    class FakeTrainer:
        def __init__(self, rank):
            self.global_rank, self.world_size = rank, 2

    seen = []
    for rank in (0, 1):
        dm.trainer = FakeTrainer(rank)
        seen.append([p["prompt"] for i in range(3) for p in dm.problems(i)])
    assert not set(seen[0][:3]) & set(seen[1][:3])  # ranks see different prompts
    dm.trainer = FakeTrainer(0)
    assert [p["prompt"] for p in dm.problems(1)] == seen[0][3:6]  # random access = resumable
    batch = dm.prompt_batch(0)
    assert batch.problems[0]["task"] == "arithmetic" and all(batch.prompt_ids)
    dm.consumed = 7
    other = RolloutDataModule(tokenizer=POLICY, prompt_file=str(f), prompts_per_step=3)
    other.load_state_dict(dm.state_dict())
    assert other.consumed == 7


def test_resume_resyncs_the_engine_and_continues_the_prompt_stream(tmp_path):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1
    )
    first, dm, _ = _fit([_callback(), ckpt], steps=2, lr=0.05)
    path = sorted(tmp_path.glob("*step=2*.ckpt"))[0]
    cb = _callback()  # a fresh engine holds the ORIGINAL weights
    module = ComposerModule(
        POLICY, [DrGRPOHead(), OPDHead()], optimizer=lambda p: torch.optim.AdamW(p, lr=0.05)
    )
    dm2 = RolloutDataModule(tokenizer=POLICY, prompts_per_step=4)
    watch = Watch(cb.engine)
    trainer = quiet_trainer(
        max_steps=3,
        callbacks=[cb, watch],
    )
    trainer.fit(module, dm2, ckpt_path=str(path))
    assert watch.seen == [(2, 2, 2, True)]  # synced to the restored weights before generating
    assert dm2.consumed == 3  # the stream continued after the 2 consumed batches
    assert float(trainer.callback_metrics["rollout/logprob_gap_max"]) < 1e-5


def test_a_judge_with_unparsable_output_gives_no_score_end_to_end():
    """The tiny policy as judge never writes 'SCORE: ±1': no sample gets a usable score, so the
    hinted (wrong) ones train OPD-only and the rest are dropped and counted. The hint check
    cannot score the hinted teacher's reply either, so by default every hint would be gated
    and the whole batch dropped: the OPD-only path is `hint_trust: always`'s."""
    from composer_lightning.tasks import LLMJudgeScore

    judge = LLMJudgeScore(HFEngine(model_path=POLICY, seed=1), tokenizer=POLICY, votes=3)
    cb = _callback(score=judge, hint_trust="always")
    _, _, trainer = _fit([cb], steps=1)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["dispatch/opd_rl"] == 0 and m["dispatch/rl_only"] == 0
    assert m["dispatch/opd_only"] + m["dispatch/dropped"] == 8 and m["dispatch/opd_only"] > 0


@pytest.mark.parametrize("world,tp", [(1, 1), (4, 1), (4, 2)])
def test_sampling_seeds_never_repeat_across_steps_or_ranks(world, tp):
    """Each call uses seeds [seed, seed + prompts × G): the ranges of different (step, group)
    never overlap, and the ranks of one tensor-parallel group share theirs."""
    from composer_lightning.rollout.generation import sampling_seed

    P, G = 3 * tp, 4  # prompts in one call: a tensor-parallel group gathers its ranks' prompts
    used: dict[int, tuple[int, int]] = {}
    for step in range(6):
        for rank in range(world):
            seed = sampling_seed(7, step, rank, world, tp, P, G)
            if rank % tp:
                assert seed == sampling_seed(7, step, rank - rank % tp, world, tp, P, G)
                continue
            for s in range(seed, seed + P * G):
                assert s not in used, (step, rank, used[s])
                used[s] = (step, rank)


def test_trace_batches_are_sharded_by_data_parallel_rank():
    from types import SimpleNamespace

    from composer_lightning.datamodules.traces import TraceDataModule
    from tests.helpers import ROOT

    seen = []
    for rank in (0, 1):
        dm = TraceDataModule(
            POLICY, str(ROOT / "examples" / "traces" / "tool_traces.jsonl"), batch_size=2
        )
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2, strategy=None)
        seen.append([tuple(row.tolist()) for row in dm.batch(0).input_ids])
    assert not set(seen[0]) & set(seen[1])


def test_the_held_out_split_is_disjoint_from_the_training_stream():
    """By construction: the training stream never draws a held-out problem, the validation set
    only held-out ones; the split depends on the problem alone (any seed, any rank)."""
    from composer_lightning.rollout.validation import is_heldout

    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=8, val_fraction=0.2, val_prompts=64)
    val = {str(p["messages"]) for p in dm.validation_problems()}
    train = {str(p["messages"]) for i in range(200) for p in dm.problems(i)}
    assert len(val) >= 40 and len(train) > 200 and not val & train
    assert all(is_heldout(p, 0.2) for p in dm.validation_problems())
    other = RolloutDataModule(tokenizer=POLICY, seed=5, val_fraction=0.2)
    assert not {str(p["messages"]) for i in range(100) for p in other.problems(i)} & val


class CountingHint(VerifierHint):
    """The verifier's hints, counting the calls."""

    calls = 0

    def hints(self, problems, completions):
        CountingHint.calls += 1
        return super().hints(problems, completions)


@pytest.mark.parametrize(
    "heads, called",
    [([DrGRPOHead()], False), ([DrGRPOHead(), OPDHead(weight=0.0)], False), (None, True)],
)
def test_no_hint_is_asked_for_while_no_head_reads_a_teacher(heads, called):
    CountingHint.calls = 0
    _, _, trainer = _fit([_callback(hint=CountingHint())], steps=2, heads=heads)
    assert (CountingHint.calls > 0) is called
    m = trainer.callback_metrics
    assert float(m["dispatch/opd_rl"]) + float(m["dispatch/opd_only"]) == (
        float(m["dispatch/opd_rl"]) if called else 0.0
    )
    if not called:  # every sample went the RL-only way: no teacher ran
        assert float(m["dispatch/rl_only"]) == 8.0


@pytest.mark.parametrize("schedule, calls", [(None, 4), (LinearRamp(1.0, 0.0, 0, 2), 2)])
def test_a_teacher_head_ramped_to_zero_asks_for_no_more_hints(schedule, calls):
    """OPD weighted 1 → 0.5 → 0 over steps 0-2: hints are asked for at steps 0 and 1 only
    (one call a step), where the constant weight asks at every step."""
    CountingHint.calls = 0
    heads = [DrGRPOHead(), OPDHead(schedule=schedule)]
    _fit([_callback(hint=CountingHint())], steps=4, heads=heads)
    assert CountingHint.calls == calls

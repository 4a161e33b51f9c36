"""The command line, plugins by entry point, configs, and checkpoint resume."""

from __future__ import annotations

import glob
import random
import subprocess
import sys

import lightning as L
import pytest
import torch
import yaml

from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.replay_dpo import ReplayDPOHead
from composer_lightning.training.module import ComposerModule
from tests.helpers import ROOT, run_cli, run_main, tiny_model

BUILTINS = ["dr_grpo", "kl", "opd", "replay_dpo", "sdpo"]


@pytest.mark.slow  # the command line in a process of its own
def test_heads_lists_every_builtin():
    out = run_cli("heads")
    assert out.returncode == 0, out.stderr
    for name in BUILTINS:
        assert f"{name} " in out.stdout and f"composer_lightning.heads.{name}." in out.stdout


@pytest.mark.slow  # the command line in a process of its own
def test_broken_plugin_is_reported_by_name_without_hiding_the_others(tmp_path):
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[composer_lightning.heads]\nbroken = no_such_module_xyz:Nope\n"
    )
    out = run_cli("heads", pythonpath=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "broken" in out.stdout and "FAILED TO IMPORT" in out.stdout
    assert "no_such_module_xyz" in out.stdout
    for name in BUILTINS:
        assert f"composer_lightning.heads.{name}." in out.stdout


@pytest.mark.slow  # pip installs the plugin, then a fit in a process of its own
def test_plugin_package_installs_and_trains_one_step(tmp_path):
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT / "examples" / "custom_head"),
        ],
        capture_output=True,
        text=True,
    )
    assert pip.returncode == 0, pip.stderr
    listed = run_cli("heads", pythonpath=str(target))
    assert (
        "length_penalty" in listed.stdout
        and "my_heads.length_penalty.LengthPenaltyHead" in listed.stdout
    )
    fit = run_cli("fit", "--config", "examples/custom_head/config.yaml", pythonpath=str(target))
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "fast_dev_run" in fit.stderr + fit.stdout


def test_unknown_head_class_is_a_clear_error(tmp_path, capfd):
    cfg = (ROOT / "examples" / "custom_head" / "config.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        cfg.replace(
            "my_heads.length_penalty.LengthPenaltyHead", "composer_lightning.heads.nope.NopeHead"
        )
    )
    out = run_main(capfd, "fit", "--config", str(bad))
    assert out.returncode != 0
    assert "composer_lightning.heads.nope.NopeHead" in out.stderr


@pytest.mark.slow  # a fit through the command line
def test_synthetic_demo_config_trains(tmp_path):
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "synthetic_demo.yaml"),
        "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert glob.glob(str(tmp_path / "synthetic_demo" / "*" / "events.*"))


def _module() -> ComposerModule:
    return ComposerModule(
        tiny_model(torch.float32), [DrGRPOHead(), ReplayDPOHead(capacity=100)], max_logprob_gap=None
    )


def test_resume_restores_weights_optimizer_head_state_and_version(tmp_path):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1
    )
    kw = dict(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    first = _module()
    L.Trainer(max_steps=3, callbacks=[ckpt], **kw).fit(
        first, SyntheticRolloutDataModule(vocab_size=64)
    )
    path = sorted(glob.glob(str(tmp_path / "*step=3*.ckpt")))[0]
    resumed = _module()
    trainer = L.Trainer(max_steps=3, enable_checkpointing=False, **kw)
    trainer.fit(resumed, SyntheticRolloutDataModule(vocab_size=64), ckpt_path=path)
    assert resumed.policy_version == first.policy_version == 3
    a, b = first.heads[1], resumed.heads[1]
    assert len(a.buffer) == len(b.buffer) > 0
    assert all(
        torch.equal(x["chosen"], y["chosen"]) for x, y in zip(a.buffer, b.buffer, strict=True)
    )
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    for (n, p), (_, q) in zip(
        first.policy.named_parameters(), resumed.policy.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    assert (
        trainer.optimizers[0].state_dict()["state"].keys()
        == first.trainer.optimizers[0].state_dict()["state"].keys()
    )


def test_checkpoint_restores_the_rng_states():
    module = _module()
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(1234)
    random.seed(1234)
    module.on_load_checkpoint(checkpoint)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.clip_low=0", "clip_low must be in (0, 1), got 0.0"),
        (
            "--model.aggregation=sum",
            "'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'token_sum_norm']. Got value: sum",
        ),
        ("--model.mixing=both", "Literal['advantage', 'loss']. Got value: both"),
        ("--model.loss_mode=gspo", "Literal['clip', 'cispo', 'sapo']. Got value: gspo"),
        (
            "--model.importance_sampling_level=seq",
            "Literal['token', 'sequence', 'sequence_token']. Got value: seq",
        ),
        ("--model.loss_mode=cispo --model.dual_clip=3", "loss_mode='cispo' has none"),
        ("--model.dual_clip=0.5", "dual_clip"),
        (
            "--model.variance_matching=dr_grpo --model.grad_norm_matching=sdpo",
            "variance_matching and grad_norm_matching exclude each other: set one",
        ),
    ],
)
def test_bad_settings_give_a_one_line_error(override, message, capfd):
    config = str(ROOT / "configs" / "synthetic_demo.yaml")
    out = run_main(capfd, "fit", "--config", config, *override.split())
    assert out.returncode != 0
    assert "invalid configuration" in out.stderr and message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.heads.weight=-1", None),  # replaced below: negative weight of the first head
        (
            "--model.temperature=0.7",
            "model.temperature (0.7) differs from rollout.sampling.temperature (1.0)",
        ),
        ("--trainer.gradient_clip_val=0.5", "set model.max_grad_norm=0.5 instead"),
        ("--trainer.accumulate_grad_batches=4", "model.max_tokens_per_micro_batch"),
        ("--data.init_args.prompt_file=/nonexistent/prompts.jsonl", "/nonexistent/prompts.jsonl"),
        (
            "--rollout.engine.init_args.model_path=/nonexistent/model",
            "VLLMEngine: model directory '/nonexistent/model' not found",
        ),
        (
            "--model.policy=no-such-org/no-such-model",
            "model.policy: no-such-org/no-such-model is not a local directory, and not in the "
            "hub cache",
        ),
        ("--model.policy=./nope", "model directory './nope' not found"),
    ],
)
def test_configuration_errors_of_the_main_job_are_one_line_before_any_engine_starts(
    override, message, tmp_path, capfd
):
    """The vLLM main job with one bad value: one line naming it, no traceback, no engine."""
    config = ROOT / "configs" / "tiny_cpu.yaml"
    if message is None:  # a negative head weight and duplicate head names, via an edited YAML
        bad = tmp_path / "bad.yaml"
        bad.write_text(
            config.read_text().replace("init_args: {weight: 0.5}", "init_args: {weight: -0.5}")
        )
        config, override, message = (
            bad,
            f"--trainer.default_root_dir={tmp_path}",
            "opd: weight must be finite and >= 0, got -0.5",
        )
    out = run_main(
        capfd, "fit", "--config", str(config), override, f"--trainer.default_root_dir={tmp_path}"
    )
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("composer_lightning:")]
    assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Repo id" not in out.stderr
    assert "Initializing a V1 LLM engine" not in out.stdout + out.stderr


def test_duplicate_head_names_are_one_line(tmp_path, capfd):
    cfg = (ROOT / "configs" / "synthetic_demo.yaml").read_text()
    bad = tmp_path / "dupes.yaml"
    bad.write_text(
        cfg.replace(
            "init_args: {weight: 1.0}\n    - class_path: composer_lightning.heads.opd.OPDHead",
            "init_args: {weight: 1.0, name: same}\n    - class_path: composer_lightning.heads.opd.OPDHead\n      init_args: {name: same}\n    - class_path: composer_lightning.heads.opd.OPDHead",
            1,
        )
    )
    out = run_main(capfd, "fit", "--config", str(bad))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "invalid configuration: duplicate head names ['same']" in out.stderr, out.stderr[-2000:]


def test_resuming_with_other_heads_is_one_error_unless_allowed_then_one_warning(caplog):
    from composer_lightning.heads.sdpo import SDPOHead
    from composer_lightning.runtime.errors import ConfigError

    checkpoint: dict = {}
    _module().on_save_checkpoint(checkpoint)  # dr_grpo + replay_dpo (a buffer)

    def other(**kw):
        heads = [DrGRPOHead(), SDPOHead()]
        return ComposerModule(tiny_model(torch.float32), heads, max_logprob_gap=None, **kw)

    with pytest.raises(ConfigError) as err:
        other().on_load_checkpoint(checkpoint)
    assert str(err.value) == (
        "cannot resume from this checkpoint with this configuration: other heads than the "
        "checkpoint's: the saved state of head(s) ['replay_dpo'] would be dropped and head(s) "
        "['sdpo'] would start fresh; resume with the checkpoint's heads, or set "
        "model.allow_head_changes=true to allow it"
    )
    with caplog.at_level("WARNING"):
        other(allow_head_changes=True).on_load_checkpoint(checkpoint)
    assert [r.getMessage() for r in caplog.records] == [
        "resuming with other heads than the checkpoint's (allow_head_changes): the saved state "
        "of ['replay_dpo'] is dropped, ['sdpo'] start fresh"
    ]


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "--rollout.sampling.temprature=0.7",
            "rollout.sampling: unknown key 'temprature' (did you mean 'temperature'?); "
            "SamplingConfig takes temperature, top_p, top_k, max_tokens, stop_token_ids, seed, "
            "ignore_eos, min_p, repetition_penalty, generation_kwargs, stop",
        ),
        (
            "--rollout.sampling.max_tokens=many",
            "rollout.sampling.max_tokens: Expected a <class 'int'>. Got value: many",
        ),
    ],
)
def test_a_misspelt_or_mistyped_nested_key_is_one_short_line(override, message, monkeypatch):
    from composer_lightning.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:1])  # pytest's arguments are not the run's
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / "configs" / "tiny_cpu_hf.yaml"), override])
    assert str(exit_.value) == f"composer_lightning: invalid configuration: {message}"


def test_a_resume_takes_the_command_lines_settings_and_says_each_difference_in_one_line(
    tmp_path, monkeypatch, caplog, capsys
):
    """`--ckpt_path` with a changed lr and group size: both are used, one line each (not the
    checkpoint's stored lr); what cannot be honoured is one line before the fit starts. The
    first run shows `default_root_dir` moving a run whose YAML logger has `save_dir: runs`."""
    from composer_lightning.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])  # pytest's arguments are not the run's
    config = ["fit", "--config", str(ROOT / "configs" / "tiny_cpu_hf.yaml")]
    first, second = tmp_path / "first", tmp_path / "second"
    main([*config, "--trainer.max_steps=1", f"--trainer.default_root_dir={first}"])
    assert (
        f"composer_lightning: trainer.default_root_dir '{first}' wins over the logger's save_dir "
        f"'runs': logs and checkpoints go under {first}\n"
    ) in capsys.readouterr().out
    ckpt = first / "tiny_cpu_hf" / "version_0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    resume = [*config, f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={second}"]
    with caplog.at_level("WARNING"):
        main(
            [
                *resume,
                "--trainer.max_steps=2",
                "--model.optimizer.init_args.lr=3e-4",
                "--rollout.init_args.group_size=2",
            ]
        )
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("composer_lightning")]
    assert "resuming with lr 0.0003 (the checkpoint was trained with 0.0001)" in lines
    assert "resuming with group_size 2 (the checkpoint was trained with 4)" in lines
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([*resume, "--model.optimizer=torch.optim.SGD", "--model.optimizer.init_args.lr=0.1"])
    assert str(exit_.value) == (
        "composer_lightning: invalid configuration: cannot resume from this checkpoint with this "
        "configuration: optimizer torch.optim.SGD (the checkpoint was trained with "
        "torch.optim.AdamW, whose saved state means nothing to another class)"
    )
    assert "composer_lightning: policy" not in capsys.readouterr().out  # the fit never started


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        # a null two class specs deep (jsonargparse alone reads it as the string "None")
        (
            "configs/tiny_cpu.yaml",
            ["--rollout.score.reward_weights=null"],
            {"fn": ["composer_lightning.tasks.math.accuracy_reward"], "reward_weights": None},
        ),
        (
            "configs/tiny_cpu.yaml",
            ["--rollout.init_args.score.init_args.reward_weights", "null"],
            {"fn": ["composer_lightning.tasks.math.accuracy_reward"], "reward_weights": None},
        ),
        # one field of model.peft, with or without init_args
        ("configs/tiny_cpu_lora.yaml", ["--model.peft.init_args.lora_dropout=0.1"], {"r": 8}),
        ("configs/tiny_cpu_lora.yaml", ["--model.peft.lora_dropout=0.1"], {"r": 8}),
    ],
)
def test_a_nested_option_written_in_yaml_can_be_overridden_on_the_command_line(
    config, overrides, expected, tmp_path, capfd
):
    score = tmp_path / "score.yaml"
    score.write_text(
        yaml.safe_dump(
            {
                "rollout": {
                    "init_args": {
                        "score": {
                            "class_path": "composer_lightning.tasks.FunctionScore",
                            "init_args": {
                                "fn": ["composer_lightning.tasks.math.accuracy_reward"],
                                "reward_weights": [1.0],
                            },
                        }
                    }
                }
            }
        )
    )
    layers = ["--config", str(ROOT / config)]
    if "lora" not in config:
        layers += ["--config", str(score)]
    out = run_main(capfd, "fit", *layers, *overrides, "--print_config")
    assert out.returncode == 0, out.stderr[-3000:]
    printed = yaml.safe_load(out.stdout)
    if "lora" in config:
        init = printed["model"]["peft"]["init_args"]
        assert printed["model"]["peft"]["class_path"] == "peft.LoraConfig"
        assert init["lora_dropout"] == 0.1 and init["target_modules"] == ["q_proj", "v_proj"]
    else:
        init = printed["rollout"]["init_args"]["score"]["init_args"]
    assert {k: init[k] for k in expected} == expected


@pytest.mark.slow  # the command line in a process of its own
def test_the_top_level_help_lists_every_command():
    out = run_cli("--help")
    assert out.returncode == 0
    commands = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    for command in ("fit", "validate", "serve", "export", "heads"):
        assert command in commands, out.stdout


def test_a_mistyped_command_lists_every_command_the_cli_runs(capfd):
    """The CLI builds the parser of the command it runs only; a command it does not know gets
    all of them, so the error names each choice."""
    out = run_main(capfd, "fitt", "--config", str(ROOT / "configs" / "tiny_cpu_hf.yaml"))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'predict')" in out.stderr
    test = run_main(
        capfd, "test", "--config", str(ROOT / "configs" / "tiny_cpu_hf.yaml"), "--print_config"
    )
    assert test.returncode == 0 and "seed_everything: 0" in test.stdout, test.stderr[-2000:]

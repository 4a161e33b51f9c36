"""Hub ids (`models/hub.py`), self-contained checkpoints (`models/stored.py`) and `export`.

Offline throughout: a hub cache in the hub's own layout (`models--org--tiny/snapshots/<rev>`,
`refs/main`) is built from the tiny policy, with `HF_HUB_OFFLINE=1` and `HF_HUB_CACHE` pointing
at it. ONE fit through the command line (`--model.policy=org/tiny`, HFEngine, 2 steps) gives
the checkpoint that the load and export tests read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.models.hub import resolve_model
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.training.module import ComposerModule

pytestmark = pytest.mark.slow  # a fit through the command line, vLLM loading the export

ROOT = Path(__file__).resolve().parents[1]
REV = "0123456789abcdef0123456789abcdef01234567"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
TEXT = "What is 12 + 30? The answer is 42."


def hub_cache(root: Path, repo: str = "org/tiny") -> Path:
    """`root` as a hub cache holding the tiny policy as `repo` at revision REV (main)."""
    storage = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(
        tiny_policy_path(),
        storage / "snapshots" / REV,
        ignore=shutil.ignore_patterns("CHECKSUMS.sha256", "build_info.json"),
    )
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(REV)
    return storage / "snapshots" / REV


def offline(mp: pytest.MonkeyPatch, cache: Path) -> None:
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_HUB_CACHE", str(cache))
    mp.setenv("HF_HOME", str(cache.parent / "hf_home"))


def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """`[T - 1]` log-probs of each token given the ones before it (plain fp32 forward)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model.float()(input_ids=x).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step CLI fit of `org/tiny` from the hub cache; the number of snapshot look-ups."""
    import huggingface_hub

    from composer_lightning.cli import main

    tmp = tmp_path_factory.mktemp("hub_run")
    snapshot = hub_cache(tmp / "cache")
    calls = []
    real = huggingface_hub.snapshot_download

    def counted(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("repo_id"))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        offline(mp, tmp / "cache")
        mp.setattr(huggingface_hub, "snapshot_download", counted)
        mp.chdir(ROOT)
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "tiny_cpu_hf.yaml"),
                "--model.policy=org/tiny",
                "--trainer.max_steps=2",
                f"--trainer.default_root_dir={tmp / 'runs'}",
            ]
        )
    ckpt = tmp / "runs" / "tiny_cpu_hf" / "version_0" / "checkpoints" / "last.ckpt"
    return {"ckpt": ckpt, "snapshot": snapshot, "calls": calls, "tmp": tmp}


def test_a_fit_by_hub_id_resolves_it_once_and_the_checkpoint_keeps_the_id(run):
    """The policy, the engine and the tokenizer all read the one snapshot: one look-up."""
    assert run["calls"] == ["org/tiny"]
    ckpt = torch.load(run["ckpt"], map_location="cpu", weights_only=False)
    assert ckpt["hyper_parameters"]["policy"] == "org/tiny"
    files = ckpt["composer"]["policy_files"]
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(files)
    assert {"tokenizer_config.json", "chat_template.jinja"} <= set(files)
    assert "model.safetensors" not in files
    assert sum(len(v) for v in files.values()) < 64_000  # compressed, weights never stored


def test_a_module_takes_a_hub_id_pinned_or_not_and_keeps_the_spec(tmp_path, monkeypatch):
    snapshot = hub_cache(tmp_path / "cache")
    offline(monkeypatch, tmp_path / "cache")
    for spec in ("org/tiny", f"org/tiny@{REV}"):
        module = ComposerModule(spec, [DrGRPOHead()])
        assert module.policy_path == str(snapshot)
        assert module.hparams["policy"] == spec
    assert resolve_model("org/tiny", revision=REV) == str(snapshot)
    with pytest.raises(FileNotFoundError, match="org/tiny@v9 is not a local directory"):
        resolve_model("org/tiny@v9")


def test_a_relative_policy_directory_is_stored_absolute(monkeypatch):
    monkeypatch.chdir(ROOT)
    module = ComposerModule("composer_lightning/assets/tiny_policy", [DrGRPOHead()])
    assert module.hparams["policy"] == module.policy_path == tiny_policy_path()


def test_a_missing_offline_model_is_one_line_naming_the_id_and_the_cache(tmp_path, monkeypatch):
    from composer_lightning.cli import main

    cache = tmp_path / "empty_cache"
    offline(monkeypatch, cache)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / "configs" / "tiny_cpu_hf.yaml"), "--model.policy=a/b"])
    assert str(exit_.value) == (
        f"composer_lightning: invalid configuration: model.policy: a/b is not a local directory, "
        f"and not in the hub cache {cache} (HF_HUB_OFFLINE is set); download it first "
        "(`hf download a/b`) or give a local directory"
    )
    for local in ("./nope", str(tmp_path / "nope")):  # not hub ids: the local error
        with pytest.raises(FileNotFoundError, match=f"model directory '{local}' not found"):
            resolve_model(local, what="model.policy")


def test_the_checkpoint_loads_from_another_directory_without_the_model(run, tmp_path, monkeypatch):
    """With the hub cache gone, the policy is rebuilt from the checkpoint's stored files; its
    weights are the trained ones (not the snapshot's), its tokenizer the snapshot's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline(monkeypatch, tmp_path / "empty_cache")
    monkeypatch.chdir(tmp_path)
    module = ComposerModule.load_from_checkpoint(run["ckpt"], map_location="cpu")
    assert module.hparams["policy"] == "org/tiny"
    assert not module.policy_path.startswith(str(run["tmp"]))  # not the (gone) snapshot
    assert "model.safetensors" not in os.listdir(module.policy_path)
    tok = AutoTokenizer.from_pretrained(module.policy_path)
    ids = tok(TEXT)["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(tiny_policy_path())(TEXT)["input_ids"]
    saved = torch.load(run["ckpt"], map_location="cpu", weights_only=False)["state_dict"]
    for name, p in module.policy.state_dict().items():
        assert torch.equal(p, saved[f"policy.{name}"]), name
    original = AutoModelForCausalLM.from_pretrained(tiny_policy_path(), dtype=torch.float32)
    assert not torch.equal(logprobs(module.policy, ids), logprobs(original, ids))  # trained


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """`export` of the fit's checkpoint, with the hub cache gone; the trainer's log-probs."""
    from composer_lightning.cli import main

    out = tmp_path_factory.mktemp("export") / "model"
    with pytest.MonkeyPatch.context() as mp:
        offline(mp, out.parent / "empty_cache")
        assert main(["export", f"--ckpt_path={run['ckpt']}", f"--out={out}"]) == 0
        module = ComposerModule.load_from_checkpoint(run["ckpt"], map_location="cpu")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_policy_path())(TEXT)["input_ids"]
    return {"out": out, "ids": ids, "trainer": logprobs(module.policy, ids)}


def test_the_export_is_an_hf_model_directory_with_the_trainers_logprobs(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = exported["out"]
    names = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gap = (logprobs(model, exported["ids"]) - exported["trainer"]).abs().max().item()
    assert gap < 1e-6, gap
    tok = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(tiny_policy_path())
    assert tok(TEXT)["input_ids"] == exported["ids"]
    assert tok.chat_template == original.chat_template
    as_trained = GenerationConfig.from_pretrained(tiny_policy_path()).to_diff_dict()
    assert GenerationConfig.from_pretrained(out).to_diff_dict() == as_trained  # not derived


def test_a_sharded_checkpoint_directory_exports_the_same_weights(run, exported, tmp_path):
    """A torch.distributed.checkpoint directory with `meta.pt`, as ModelParallelStrategy
    writes one (`save_distributed_checkpoint=True`), read on one process."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from composer_lightning.models.export import export

    ckpt = torch.load(run["ckpt"], map_location="cpu", weights_only=False)
    sharded = tmp_path / "last.ckpt"
    dcp.save({"state_dict": ckpt.pop("state_dict")}, checkpoint_id=sharded)
    torch.save(ckpt, sharded / "meta.pt")
    export(str(sharded), str(tmp_path / "out"))
    mine, theirs = (load_file(d / "model.safetensors") for d in (tmp_path / "out", exported["out"]))
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_export_errors_are_one_line(tmp_path):
    from composer_lightning.cli import main
    from composer_lightning.models.export import push_to_hub

    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}}, other)
    with pytest.raises(SystemExit) as exit_:
        main(["export", f"--ckpt_path={other}", f"--out={tmp_path / 'x'}"])
    assert str(exit_.value) == (
        f"composer_lightning: export: checkpoint {str(other)!r} holds no policy weights (no "
        "'policy.*' keys in its state_dict); expected a checkpoint of composer_lightning's "
        "ComposerModule"
    )
    with pytest.raises(Exception, match="127.0.0.1:9|onnect"):  # the push runs up to the network
        push_to_hub(str(tmp_path), "org/tiny", endpoint="http://127.0.0.1:9")


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed (pip install -e .[cpu])")
def test_vllm_loads_the_export_as_it_is_with_the_trainers_logprobs(exported, tmp_path):
    """vLLM (in a subprocess: it changes the process) loads the directory with its tokenizer
    and scores the fixed sequence. fp32 on both sides, so the gap is the kernels' rounding:
    measured 1.8e-6 mean, 6.4e-6 max here (the canary's fp32 threshold is 1e-3; its gaps in
    training ≈ 2e-7 mean; an engine one push behind measured ≈ 0.23, ENVIRONMENT.md)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_vllm_export.py"), str(exported["out"]), TEXT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ids"] == exported["ids"]  # vLLM's own tokenizer of the export
    gap = (torch.tensor(got["logprobs"]) - exported["trainer"]).abs()
    print(f"vLLM vs trainer: mean {gap.mean().item():.2e}, max {gap.max().item():.2e}")
    assert gap.mean().item() < 1e-5 and gap.max().item() < 5e-5, gap

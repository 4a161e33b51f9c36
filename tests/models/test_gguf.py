"""A GGUF file as a model source (`models/gguf.py`), on small files the tests write themselves.

The shipped tiny policy is written as GGUF the way llama.cpp's converter writes a Llama
(`_gguf_writer.py`): F32 (a lossless round trip) and Q8_0 (dequantised on load). The converted
directory must give transformers' own GGUF-loaded model's log-probs, every component must read
it, and each bad file is one line naming it.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from composer_lightning.models.gguf import gguf_path, resolve_gguf  # noqa: E402
from composer_lightning.models.hub import resolve_model  # noqa: E402
from composer_lightning.models.loading import absolute_spec, load_policy  # noqa: E402
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from tests.helpers import run_cli, run_main  # noqa: E402
from tests.models._gguf_writer import write_llama_gguf  # noqa: E402

CHAT = [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        "F32": write_llama_gguf(tiny_policy_path(), root / "tiny-f32.gguf"),
        "Q8_0": write_llama_gguf(tiny_policy_path(), root / "tiny-q8_0.gguf", "Q8_0"),
    }


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_LIGHTNING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """`[T - 1]` log-probs of each token given the ones before it (float64)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("quantization", ["F32", "Q8_0"])
def test_the_converted_model_gives_transformers_gguf_models_logprobs(files, quantization):
    path = files[quantization]
    directory = resolve_gguf(str(path))
    ours = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert ids == reference.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor(ids)
    assert torch.allclose(logprobs(ours, ids), logprobs(theirs, ids), atol=1e-6, rtol=0)
    assert "quantization_config" not in ours.config.to_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_policy_path(), dtype=torch.float32).eval()
    gap = (logprobs(ours, ids) - logprobs(original, ids)).abs().max().item()
    if quantization == "F32":  # lossless: the file's layout undone exactly
        assert gap < 1e-6
    else:  # Q8_0: the file's own (dequantised) values, close to the original's
        assert 1e-6 < gap < 0.1


def test_a_file_converts_once_per_content_and_again_when_it_changes(files, cache, tmp_path):
    first = resolve_gguf(str(files["F32"]))
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    copy = shutil.copy(files["F32"], tmp_path / "elsewhere.gguf")
    assert resolve_gguf(str(copy)) == first  # same content, same directory, not rebuilt
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert resolve_gguf(str(files["Q8_0"])) != first
    assert [d for d in os.listdir(cache / "gguf") if d.startswith(".")] == []  # no build left


def test_every_component_reads_a_gguf_spec_through_one_resolution(files):
    spec = str(files["F32"])
    directory = resolve_gguf(spec)
    assert resolve_model(spec, what="model.policy") == directory
    assert resolve_model(spec, what="tokenizer", require="tokenizer_config.json") == directory
    path, policy = load_policy(spec)
    assert path == directory and policy.training
    relative = os.path.relpath(spec)
    assert absolute_spec(relative) == spec  # the checkpoint keeps the source, absolute


def test_a_file_inside_an_installed_package_is_a_spec(tmp_path, monkeypatch, files):
    package = tmp_path / "site" / "my_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    shutil.copy(files["F32"], package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf_path("pkg:my_weights/tiny.gguf") == str(package / "tiny.gguf")
    assert resolve_model("pkg:my_weights/tiny.gguf") == resolve_gguf(str(files["F32"]))


def one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


def test_bad_files_are_one_line_naming_the_file(files, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError) as err:
        resolve_gguf(str(corrupt))
    one_line(err, str(corrupt), "not a GGUF file", "expected b'GGUF'")

    truncated = tmp_path / "truncated.gguf"
    data = files["F32"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as err:
        resolve_gguf(str(truncated))
    one_line(err, str(truncated), "cannot read", "expected a GGUF file of an architecture")

    other = write_llama_gguf(tiny_policy_path(), tmp_path / "other.gguf", architecture="nope")
    with pytest.raises(ValueError) as err:
        resolve_gguf(str(other))
    one_line(err, str(other), "nope")

    with pytest.raises(FileNotFoundError) as err:
        resolve_model(str(tmp_path / "missing.gguf"), what="model.policy")
    one_line(err, "model.policy", "missing.gguf", f"the directory {tmp_path} has no missing.gguf")

    with pytest.raises(FileNotFoundError) as err:
        resolve_model("pkg:no_such_package_here/x.gguf")
    one_line(err, "no_such_package_here", "not installed")


@pytest.mark.slow  # a fit through the command line with vLLM
def test_fit_trains_a_gguf_policy_with_vllm_in_sync(files, tmp_path, cache):
    """The command line end to end: trainer, vLLM engine and tokenizer all read the converted
    directory; the canary (engine vs trainer log-probs, weight fingerprints) holds."""
    out = run_cli(
        "fit",
        "--config",
        "configs/tiny_cpu.yaml",
        f"--model.policy={files['F32']}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=null",
        f"--trainer.default_root_dir={tmp_path}",
        env={"COMPOSER_LIGHTNING_CACHE": str(cache)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 2/2" in out.stdout + out.stderr


def test_a_bad_gguf_policy_on_the_command_line_is_one_line(tmp_path, capfd):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    out = run_main(capfd, "fit", "--config", "configs/tiny_cpu.yaml", f"--model.policy={bad}")
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if str(bad) in line]
    assert lines and "cannot read" in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr

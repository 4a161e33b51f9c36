"""LoRA policies (`models/lora.py`, `ComposerModule(peft=...)`): engines get exactly peft's
merged weights under the base names, the reference is the base model (no copy), only the
adapters train, the canary stays at the fp32 level, checkpoints resume bitwise and export
merged or as an adapter. The vLLM run: `configs/tiny_cpu_lora.yaml` in test_configs_fit.py."""

from __future__ import annotations

import copy
import glob
import os
import socket
import subprocess
import sys

import lightning as L
import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, PeftModel  # noqa: E402

from composer_lightning.datamodules.rollout import RolloutDataModule  # noqa: E402
from composer_lightning.engines import HFEngine, SamplingConfig, iter_hf_weights  # noqa: E402
from composer_lightning.functional import sequence_logprobs  # noqa: E402
from composer_lightning.heads.dr_grpo import DrGRPOHead  # noqa: E402
from composer_lightning.heads.kl import KLHead  # noqa: E402
from composer_lightning.models.export import export  # noqa: E402
from composer_lightning.models.loading import load_causal_lm  # noqa: E402
from composer_lightning.models.lora import lora_policy  # noqa: E402
from composer_lightning.models.tiny import tiny_policy_path  # noqa: E402
from composer_lightning.rollout.callback import RolloutCallback  # noqa: E402
from composer_lightning.runtime.errors import ConfigError  # noqa: E402
from composer_lightning.tasks import VerifierHint  # noqa: E402
from composer_lightning.training.forward import score_tokens  # noqa: E402
from composer_lightning.training.module import ComposerModule  # noqa: E402
from tests.helpers import (  # noqa: E402
    ROOT,  # noqa: E402
    one_sample_batch,
    quiet_trainer,
    tiny_model,
)

POLICY = tiny_policy_path()


def _lora(**kw) -> LoraConfig:
    args = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return LoraConfig(**(args | kw))


def _randomise(policy: torch.nn.Module, seed: int = 1) -> None:
    """peft starts B at zero (the merged model is the base); give the adapters a real update."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _batch():
    return one_sample_batch(
        [3, 4, 5], [6, 7, 8, 9], [10], reward=1.0, has_reward=True, has_teacher=False
    )


def test_pushed_weights_are_peft_own_merge_under_the_base_names():
    """float64: every pushed tensor equals peft's `merge_and_unload()` bitwise, and a targeted
    one is W + (alpha / r) · B @ A (alpha / r = 8 / 4 = 2) by hand."""
    base = tiny_model(torch.float64)
    policy = lora_policy(copy.deepcopy(base), _lora())
    _randomise(policy)
    pushed = list(iter_hf_weights(policy))
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert [n for n, _ in pushed] == [n for n, _ in base.named_parameters(remove_duplicate=False)]
    for name, tensor in pushed:
        assert torch.equal(tensor, merged[name]), name
    pushed = dict(pushed)
    q = policy.base_model.model.model.layers[0].self_attn.q_proj
    by_hand = q.base_layer.weight + 2.0 * q.lora_B.default.weight @ q.lora_A.default.weight
    torch.testing.assert_close(
        pushed["model.layers.0.self_attn.q_proj.weight"], by_hand, rtol=0, atol=1e-12
    )
    k = "model.layers.0.self_attn.k_proj.weight"  # not targeted: as it is
    assert torch.equal(pushed[k], dict(base.named_parameters())[k])
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight)


def test_the_reference_is_the_base_model_and_costs_no_copy():
    base = tiny_model(torch.float64)
    module = ComposerModule(
        copy.deepcopy(base), [DrGRPOHead(), KLHead()], peft=_lora(), max_logprob_gap=None
    )
    _randomise(module.policy)
    rb = _batch()
    expected = score_tokens(
        base, rb.input_ids, rb.attention_mask, temperature=1.0, mask=rb.response_mask
    ).logprobs
    targets = module.rollout_targets(rb, {"ref_logprobs"})
    assert torch.equal(targets.ref_logprobs, expected)
    ctx = module.step_context(rb, {"ref_logprobs", "sequence_logprobs"}, targets)
    assert not torch.allclose(ctx.logprobs, expected)  # the adapters are on for the policy
    assert torch.equal(  # replay DPO's path: the same base model
        ctx.reference_sequence_logprobs(rb.input_ids, rb.attention_mask, rb.response_mask),
        sequence_logprobs(expected, rb.response_mask),
    )
    assert all(k.startswith("policy.") for k in module.state_dict())  # no second copy
    assert sum(p.numel() for p in module.parameters()) == sum(
        p.numel() for p in module.policy.parameters()
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(target_modules=["q_proj", "lm_head"]), "LM head"),
        (dict(use_dora=True), "use_dora"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ],
)
def test_what_the_push_cannot_merge_is_a_configuration_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        lora_policy(tiny_model(torch.float32), _lora(**kw))


class Gaps(L.Callback):
    def __init__(self):
        self.gaps: list[float] = []

    def on_train_batch_end(self, trainer, *args):
        self.gaps.append(float(trainer.callback_metrics["rollout/logprob_gap_mean"]))


@pytest.fixture(scope="module")
def lora_fit(tmp_path_factory):
    """3 steps of the tiny policy with LoRA at lr 1e-2, HF `generate` engine, a checkpoint."""
    tmp = tmp_path_factory.mktemp("lora_fit")
    torch.manual_seed(0)
    module = ComposerModule(
        POLICY,
        [DrGRPOHead(), KLHead(kl_coef=0.1)],
        peft=_lora(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    engine = HFEngine(model_path=POLICY, seed=0)
    cb = RolloutCallback(
        engine, group_size=2, sampling=SamplingConfig(max_tokens=6, seed=0), hint=VerifierHint()
    )
    gaps = Gaps()
    trainer = quiet_trainer(
        max_steps=3,
        callbacks=[cb, gaps, L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp)],
    )
    trainer.fit(module, RolloutDataModule(tokenizer=POLICY, prompts_per_step=4))
    (ckpt,) = glob.glob(str(tmp / "*.ckpt"))
    return module, engine, gaps.gaps, ckpt, trainer


def test_only_the_adapters_train_and_the_canary_stays_at_fp32_level(lora_fit):
    module, engine, gaps, _, trainer = lora_fit
    base = dict(load_causal_lm(POLICY).named_parameters())
    trained = dict(module.policy.named_parameters())
    (group,) = trainer.optimizers[0].param_groups
    assert {id(p) for p in group["params"]} == {id(p) for n, p in trained.items() if "lora_" in n}
    for name, p in trained.items():
        if "lora_" not in name:
            assert torch.equal(
                p, base[name.removeprefix("base_model.model.").replace(".base_layer.", ".")]
            ), name
        elif "lora_B" in name:
            assert p.abs().max() > 0, name  # the adapters moved
    pushed = dict(iter_hf_weights(module.policy))
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, pushed[name]), name  # the engine holds the merged weights
    assert not torch.equal(
        pushed["model.layers.0.self_attn.q_proj.weight"],
        base["model.layers.0.self_attn.q_proj.weight"],
    )
    assert len(gaps) == 3 and max(gaps) < 1e-5, gaps  # fp32: a healthy push is ≈ 1e-7


def test_export_writes_the_merged_model_or_the_adapter(lora_fit, tmp_path):
    from transformers import AutoModelForCausalLM

    module, _, _, ckpt, _ = lora_fit
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        expected = module.policy(input_ids=ids).logits
    export(ckpt, str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM"
    pushed = dict(iter_hf_weights(module.policy))
    for name, p in merged.named_parameters():
        assert torch.equal(p, pushed[name]), name
    with torch.no_grad():  # the merged model is the LoRA policy (peft's own forward)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    names = export(ckpt, str(tmp_path / "adapter"), adapter=True)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(names)
    loaded = PeftModel.from_pretrained(load_causal_lm(POLICY), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)


def test_an_adapter_trained_from_a_pinned_hub_id_names_its_base_as_peft_reads_it(
    lora_fit, tmp_path
):
    """`org/name@v1.0` goes to adapter_config.json as the id and the revision, which peft
    passes on to the hub; a local directory is written as it is."""
    import json

    ckpt = lora_fit[3]
    state = torch.load(ckpt, weights_only=False)
    for spec, name, revision in (("org/tiny@v1.0", "org/tiny", "v1.0"), (POLICY, POLICY, None)):
        state["hyper_parameters"]["policy"] = spec
        pinned = tmp_path / "pinned.ckpt"
        torch.save(state, pinned)
        out = tmp_path / f"adapter-{revision}"
        export(str(pinned), str(out), adapter=True)
        config = json.loads((out / "adapter_config.json").read_text())
        assert (config["base_model_name_or_path"], config["revision"]) == (name, revision)


def _resume_run(tmp_path, steps, ckpt_path=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # peft draws A's initial values from the global RNG
    module = ComposerModule(
        POLICY,
        [DrGRPOHead(), KLHead(kl_coef=0.1)],
        peft=_lora(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    cb = RolloutCallback(
        HFEngine(model_path=POLICY, seed=0),
        group_size=2,
        sampling=SamplingConfig(max_tokens=6, seed=0),
        hint=VerifierHint(),
    )
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=[cb, L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path)],
    )
    dm = RolloutDataModule(tokenizer=POLICY, prompts_per_step=4)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_a_resumed_lora_run_equals_the_uninterrupted_one(tmp_path):
    whole = _resume_run(tmp_path / "whole", 4)
    _resume_run(tmp_path / "half", 2)
    (ckpt,) = glob.glob(str(tmp_path / "half" / "*.ckpt"))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["composer"]["peft_config"]["r"] == 4
    assert any("lora_A" in k for k in saved["state_dict"])
    resumed = _resume_run(tmp_path / "resumed", 4, ckpt_path=ckpt)
    assert resumed.keys() == whole.keys()
    for name, w in whole.items():
        assert torch.equal(resumed[name], w), name


@pytest.mark.slow  # two ranks in processes of their own
def test_fsdp2_on_two_ranks_gathers_the_merged_weights_and_trains_the_adapters_only():
    """tests/_lora_fsdp2.py: two gloo ranks, the LoRA policy sharded per decoder layer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_lora_fsdp2.py"), port],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_resuming_a_lora_checkpoint_without_model_peft_says_so():
    lora = ComposerModule(tiny_model(torch.float32), [DrGRPOHead()], peft=_lora())
    plain = ComposerModule(tiny_model(torch.float32), [DrGRPOHead()])
    checkpoint = {"state_dict": lora.state_dict()}
    (refused,) = plain.resume_differences(checkpoint, 1).refused
    assert "the checkpoint trained LoRA adapters (model.peft); this run has none" in refused
    (refused,) = lora.resume_differences({"state_dict": plain.state_dict()}, 1).refused
    assert "this run has LoRA adapters" in refused

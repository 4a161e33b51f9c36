"""`python -m composer_lightning export --ckpt_path CKPT --out DIR [--push_to_hub REPO_ID]`.

Writes the trained policy of a `ComposerModule` checkpoint as a Hugging Face model directory
that `transformers` (`AutoModelForCausalLM`, `AutoTokenizer`) and vLLM load as it is: weights
in safetensors (sharded with an index above 5 GB, tied weights once), `config.json`,
`generation_config.json`, the tokenizer files and the chat template. The configs and tokenizer
come from the checkpoint itself (`models/stored.py`), so the directory the run was trained from
is not needed; a checkpoint written before they were stored falls back on that directory (or
`--model_dir`).

A checkpoint is a Lightning file, or a sharded directory written by ModelParallelStrategy with
`save_distributed_checkpoint=True` (torch.distributed.checkpoint; read on one process, all of
the policy in memory at once). Only the policy is exported, never the reference or teacher.

A LoRA policy (`model.peft`) is exported merged by default (`W + B @ A · scale`, the weights
engines are pushed, under the base model's names: a plain model of the base architecture); with
`--adapter` the peft adapter alone (`adapter_model.safetensors`, `adapter_config.json`), which
`PeftModel.from_pretrained(base, DIR)` loads onto the base model.
Checkpoints are unpickled: export only checkpoints you trust, as with `torch.load`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from composer_lightning.models.hub import looks_like_hub_id, split_revision
from composer_lightning.models.stored import (
    checkpoint_meta,
    stored_model_files,
    write_model_files,
)

#: What `--dtype` takes: `auto` keeps the checkpoint's (the trainer's fp32 master weights).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def policy_state_dict(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The policy's weights under their HF names, and the rest of the checkpoint (without its
    `state_dict`).

    Raises:
        ValueError: the checkpoint holds no `policy.*` weights (not a ComposerModule's).
    """
    from composer_lightning.models.weights import hf_name

    meta = checkpoint_meta(path)
    state = _sharded_state_dict(path) if os.path.isdir(path) else meta.pop("state_dict", {})
    meta.pop("state_dict", None)
    weights = {hf_name(k[len("policy.") :]): v for k, v in state.items() if k.startswith("policy.")}
    if not weights:
        raise ValueError(
            f"checkpoint {path!r} holds no policy weights (no 'policy.*' keys in its "
            "state_dict); expected a checkpoint of composer_lightning's ComposerModule"
        )
    return weights, meta


def _sharded_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The full `state_dict` of a torch.distributed.checkpoint directory, on one process
    (what `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` does, without the
    optimizer states)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    _load_state_dict(
        loaded,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}),
        no_dist=True,
    )
    return loaded.get("state_dict", {})


def _model_files(path: str, meta: dict[str, Any], model_dir: str | None) -> dict[str, bytes]:
    """The configs and tokenizer: `model_dir`, else the checkpoint's, else the directory the
    policy was trained from (older checkpoints)."""
    from composer_lightning.models.hub import resolve_model
    from composer_lightning.models.stored import read_model_files

    if model_dir is not None:
        return read_model_files(resolve_model(model_dir, what="--model_dir"))
    files = stored_model_files(meta)
    if "config.json" in files:
        return files
    spec = (meta.get("hyper_parameters") or {}).get("policy")
    if not isinstance(spec, str):
        raise ValueError(
            f"checkpoint {path!r} stores no model config and its policy is not a model "
            "directory; pass --model_dir with the policy's config and tokenizer"
        )
    try:
        return read_model_files(resolve_model(spec, what="the checkpoint's policy"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{exc}; the checkpoint stores no model config: pass --model_dir with the "
            "policy's config and tokenizer"
        ) from None


def export(
    ckpt_path: str,
    out: str,
    dtype: str = "auto",
    model_dir: str | None = None,
    adapter: bool = False,
) -> list[str]:
    """Write the policy of `ckpt_path` as an HF model directory `out`.

    Args:
        ckpt_path: a ComposerModule checkpoint (file, or sharded directory).
        out: the directory to write (created; files of the same names are replaced).
        dtype: the weights' dtype; `auto` keeps the checkpoint's.
        model_dir: where to take config and tokenizer from, instead of the checkpoint.
        adapter: write a LoRA policy's peft adapter instead of the merged model.

    Returns:
        The names of the files written.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    weights, meta = policy_state_dict(ckpt_path)
    lora = (meta.get("composer") or {}).get("peft_config")
    if adapter and not lora:
        raise ValueError(
            f"checkpoint {ckpt_path!r} holds no LoRA adapter (trained without model.peft): "
            "export it without --adapter"
        )
    files = _model_files(ckpt_path, meta, model_dir)
    if lora:
        spec = (meta.get("hyper_parameters") or {}).get("policy")
        if isinstance(spec, str):  # the hub id or directory trained from, not a temporary copy
            # peft reads a pinned hub id as `base_model_name_or_path` + `revision`
            name, revision = split_revision(spec) if looks_like_hub_id(spec) else (spec, None)
            lora = dict(lora, base_model_name_or_path=name, revision=revision)
        weights = _from_lora(weights, lora, files, out if adapter else None, dtype)
        if adapter:
            return sorted(os.listdir(out))
    os.makedirs(out, exist_ok=True)
    write_model_files(files, out)  # configs, tokenizer, chat template
    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):  # no second copy of the weights: the checkpoint's are assigned
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if k not in _tied_names(model)]
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's policy weights do not fit its config ({config.model_type}): "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected "
            f"{unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    model.tie_weights()
    if dtype != "auto":
        model.to(getattr(torch, dtype))
    if "generation_config.json" in files:  # as trained (EOS ids, sampling defaults), not derived
        model.generation_config = GenerationConfig.from_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    return sorted(os.listdir(out))


def _from_lora(
    weights: dict[str, torch.Tensor],
    config: dict[str, Any],
    files: dict[str, bytes],
    adapter_out: str | None,
    dtype: str,
) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's merged weights under the base model's names; with `adapter_out`,
    the peft adapter is written there instead."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    from composer_lightning.models.lora import lora_model_from_state
    from composer_lightning.models.weights import merged_hf_weights

    with tempfile.TemporaryDirectory() as tmp:
        write_model_files({k: v for k, v in files.items() if k == "config.json"}, tmp)
        base_config = AutoConfig.from_pretrained(tmp)
    base_config.name_or_path = config.get("base_model_name_or_path") or ""
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(base_config)
    model = lora_model_from_state(base, config, weights)
    if adapter_out is None:
        return dict(merged_hf_weights(model))
    if dtype != "auto":
        model.to(getattr(torch, dtype))
    model.save_pretrained(adapter_out, safe_serialization=True)  # type: ignore[operator]  # peft's
    return {}


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that share a tensor with an earlier one (a tied LM head)."""
    names = dict(model.named_parameters(remove_duplicate=False))
    kept = dict(model.named_parameters())
    return set(names) - set(kept) if getattr(model.config, "tie_word_embeddings", False) else set()


def push_to_hub(
    folder: str, repo_id: str, private: bool = False, endpoint: str | None = None
) -> str:
    """Create `repo_id` on the hub if needed and upload `folder` to it; the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        repo_type="model",
        commit_message="Upload policy exported by composer_lightning",
    )
    return str(getattr(info, "commit_url", info))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m composer_lightning export",
        description="Write a checkpoint's policy as a Hugging Face model directory.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint file or sharded directory")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weights' dtype")
    parser.add_argument("--model_dir", help="config and tokenizer instead of the checkpoint's")
    parser.add_argument(
        "--adapter", action="store_true", help="a LoRA policy's peft adapter, not merged"
    )
    parser.add_argument("--push_to_hub", metavar="REPO_ID", help="also upload to this hub repo")
    parser.add_argument("--private", action="store_true", help="a new hub repo is private")
    args = parser.parse_args(argv)
    if not os.path.exists(args.ckpt_path):
        raise SystemExit(f"composer_lightning: export: checkpoint {args.ckpt_path!r} not found")
    try:
        names = export(args.ckpt_path, args.out, args.dtype, args.model_dir, args.adapter)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise SystemExit(f"composer_lightning: export: {exc}") from None
    print(f"composer_lightning: exported {args.ckpt_path} to {args.out}: {', '.join(names)}")
    if args.push_to_hub:
        try:
            url = push_to_hub(args.out, args.push_to_hub, args.private)
        except Exception as exc:  # network, authentication, permissions: one line
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise SystemExit(
                f"composer_lightning: export: pushing {args.out} to {args.push_to_hub} "
                f"failed: {type(exc).__name__}: {reason}"
            ) from None
        print(f"composer_lightning: pushed to {args.push_to_hub}: {url}")
    return 0

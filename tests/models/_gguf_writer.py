"""Write a small Llama GGUF file from an HF model directory, as llama.cpp's converter does.

For tests only: the shipped tiny policy becomes a GGUF file of a few hundred KiB (F32 or Q8_0
weights), so the GGUF path is tested without a large file. The layout is llama.cpp's
(`convert_hf_to_gguf.py`, `LlamaModel`): tensor names `blk.N.attn_q` …, the query and key rows
permuted for its rotary layout, a tied LM head left out, a byte-level BPE tokenizer as
`tokenizer.ggml.model = gpt2` with its tokens, merges and token types.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

#: HF parameter name pieces → GGUF tensor names (per decoder layer: `blk.N.`).
LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's query/key row permutation (`LlamaModel.permute`)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}"
    return None


def write_llama_gguf(
    model_dir: str | Path,
    path: str | Path,
    quantization: str = "F32",
    architecture: str = "llama",
    add_bos: bool = False,
) -> Path:
    """Write `model_dir` (an HF Llama directory with a byte-level BPE tokenizer) as GGUF.

    Args:
        quantization: "F32", or "Q8_0" for the 2-D weights (norms stay F32, as llama.cpp does).
        architecture: `general.architecture` (another value makes a file transformers refuses).
        add_bos: `tokenizer.ggml.add_bos_token` (the tiny policy's template writes its BOS).
    """
    import gguf
    from safetensors.torch import load_file

    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tok_config["chat_template"]

    writer = gguf.GGUFWriter(str(path), architecture)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    tokens = [name for name, _ in vocab]
    for i, t in added.items():  # added tokens are in the vocab too; keep their text
        tokens[i] = t["content"]
    # transformers' byte-level GGUF tokenizer always holds GPT-2's unknown token `<|endoftext|>`
    # (it adds one past the vocabulary when the file has none): the pad token is written under
    # that name, as the unknown token, so the vocabulary keeps the embedding's size
    tokens[config["pad_token_id"]] = "<|endoftext|>"
    types = [
        gguf.TokenType.CONTROL if added.get(i, {}).get("special") else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_unk_token_id(config["pad_token_id"])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(template)

    qtype = getattr(gguf.GGMLQuantizationType, quantization)
    for hf, tensor in weights.items():
        name = gguf_name(hf)
        if name is None or (hf == "lm_head.weight" and config.get("tie_word_embeddings")):
            continue
        data = tensor.to(torch.float32).numpy()
        if name.endswith("attn_q.weight"):
            data = permute(data, n_head)
        elif name.endswith("attn_k.weight"):
            data = permute(data, n_kv)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

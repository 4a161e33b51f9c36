import pytest
from transformers import GenerationConfig

from composer_lightning.models.random import build_random_llama, load_policy


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 0.15M-parameter random Llama (head_dim 32, vocab 512), fp32 safetensors, whose
    generation config declares 32 EOS ids (as Qwen and Llama-3 declare several)."""
    path = build_random_llama(tmp_path_factory.mktemp("engines") / "tiny_llama", seed=0)
    GenerationConfig(bos_token_id=0, eos_token_id=list(range(1, 64, 2))).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_policy(tiny_llama_dir):
    return load_policy(tiny_llama_dir)

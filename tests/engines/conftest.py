import pytest

from composer_lightning.models.random import build_random_llama, load_policy


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 0.15M-parameter random Llama (head_dim 32, vocab 512), fp32 safetensors."""
    return build_random_llama(tmp_path_factory.mktemp("engines") / "tiny_llama", seed=0)


@pytest.fixture(scope="session")
def tiny_policy(tiny_llama_dir):
    return load_policy(tiny_llama_dir)

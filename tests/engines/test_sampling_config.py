import pytest
from transformers import AutoTokenizer

from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.engines.base import stop_text_ids
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.rollout.callback import RolloutCallback


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"stop": "\n"}, "stop"),
        ({"stop": ["\n", ""]}, "stop"),
    ],
)
def test_bad_sampling_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        SamplingConfig(**kwargs)
    value = next(iter(kwargs.values()))
    assert (repr(value) if isinstance(value, str | list) else str(value)) in str(err.value)


def test_defaults():
    s = SamplingConfig()
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop_token_ids, s.seed) == (
        1.0,
        1.0,
        None,
        32,
        [],
        None,
    )
    assert SamplingConfig(top_k=0).top_k_or_none is None


def test_stop_texts_become_the_ids_of_every_token_holding_them():
    """A base model does not stop on its own: `stop: ["\\n"]` ends a reply at the first token
    whose text holds a newline, whichever token that is; the rollout callback adds those ids
    (with the tokenizer's EOS) to what every engine reads, once per tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_path())
    ids = stop_text_ids(tokenizer, ["\n"])
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    assert ids == [i for i, text in enumerate(texts) if "\n" in text] and ids
    assert stop_text_ids(tokenizer, []) == []
    callback = RolloutCallback(HFEngine(), sampling=SamplingConfig(stop=["\n"], max_tokens=4))
    sampling = callback._sampling(tokenizer)
    assert set(ids) | {tokenizer.eos_token_id} == set(sampling.stop_token_ids)
    assert sampling.stop == []  # resolved: engines read ids only

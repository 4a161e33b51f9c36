import pytest

from composer_lightning.engines import SamplingConfig


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        SamplingConfig(**kwargs)
    assert str(next(iter(kwargs.values()))) in str(err.value)


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

"""`masked_aggregate` against loop references, hand examples and NaN/empty-mask invariants."""

import math

import pytest
import torch

from composer_lightning.functional import masked_aggregate

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]


def ref_aggregate(values, mask, mode, norm_length=None):
    """Loop reference over nested lists."""
    rows = [
        [v for v, m in zip(vr, mr, strict=True) if m] for vr, mr in zip(values, mask, strict=True)
    ]
    tokens = [v for row in rows for v in row]
    if mode == "token_mean":
        return sum(tokens) / len(tokens) if tokens else 0.0
    if mode == "token_sum_norm":
        return sum(tokens) / (len(values) * norm_length)
    # a row without a masked token counts as 0 over all the rows (TRL's `grpo` / `sapo`)
    if mode == "seq_mean_token_mean":
        return sum(sum(row) / len(row) for row in rows if row) / len(rows)
    return sum(sum(row) for row in rows) / len(rows)


@pytest.mark.parametrize("mode", MODES)
def test_matches_loop_reference(mode):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[2] = False  # a sequence with no masked token
    got = masked_aggregate(values, mask, mode, norm_length=9)
    want = ref_aggregate(values.tolist(), mask.tolist(), mode, 9)
    assert abs(got.item() - want) < 1e-12
    float_mask = masked_aggregate(values, mask.double(), mode, norm_length=9)
    assert float_mask.item() == got.item()


def test_token_sum_norm_hand_example():
    """values [[1,2,3,4],[5,6,7,8]], mask [[1,1,1,0],[1,0,0,0]], B=2, norm_length=4:
    (1 + 2 + 3 + 5) / (2 * 4) = 11 / 8 = 1.375."""
    values = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert masked_aggregate(values, mask, "token_sum_norm", norm_length=4).item() == 1.375


def test_seq_modes_hand_example():
    """Same values/mask: per-sequence means 2 and 5 -> 3.5; per-sequence sums 6 and 5 -> 5.5;
    token mean 11 / 4 = 2.75."""
    values = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert masked_aggregate(values, mask, "seq_mean_token_mean").item() == 3.5
    assert masked_aggregate(values, mask, "seq_mean_token_sum").item() == 5.5
    assert masked_aggregate(values, mask, "token_mean").item() == 2.75


def test_a_row_masked_out_whole_counts_in_the_sequence_mean_as_trls_grpo_loss():
    """A third row with no masked token (a truncated completion, masked): the per-sequence
    means 2, 5 and 0 over three rows, 7 / 3, not 3.5 over the two non-empty ones; TRL 1.16's
    `loss_type="grpo"` reduction, `((l * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()`."""
    values = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    m = mask.double()
    trl_grpo = ((values * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    got = masked_aggregate(values, mask, "seq_mean_token_mean")
    assert got.item() == pytest.approx(7 / 3, abs=1e-15) == trl_grpo.item()
    assert masked_aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx(11 / 3)


@pytest.mark.parametrize("mode", MODES)
def test_nan_off_mask_and_zero_gradient(mode):
    values = torch.tensor([[1.0, math.nan, 3.0], [math.inf, 2.0, -math.inf]], dtype=torch.float64)
    values.requires_grad_(True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    out = masked_aggregate(values, mask, mode, norm_length=3)
    assert torch.isfinite(out)
    out.backward()
    assert torch.isfinite(values.grad).all()
    assert (values.grad[~mask] == 0).all()
    assert (values.grad[mask] != 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_empty_mask_is_attached_zero(mode):
    values = torch.full((2, 3), math.nan, dtype=torch.float64, requires_grad=True)
    out = masked_aggregate(values, torch.zeros(2, 3, dtype=torch.bool), mode, norm_length=3)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert (values.grad == 0).all()


def test_errors():
    v = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"'bogus'.*token_mean, seq_mean_token_mean"):
        masked_aggregate(v, torch.ones(2, 5), "bogus")
    with pytest.raises(ValueError, match="norm_length is required"):
        masked_aggregate(v, torch.ones(2, 5), "token_sum_norm")
    with pytest.raises(ValueError, match=r"norm_length must be in \(0, inf\), got -1"):
        masked_aggregate(v, torch.ones(2, 5), "token_sum_norm", norm_length=-1)
    with pytest.raises(
        ValueError, match=r"values \[2, 5\] and mask \[2, 4\] must have the same shape"
    ):
        masked_aggregate(v, torch.ones(2, 4), "token_mean")
    with pytest.raises(ValueError, match=r"values must be 2-D, got shape \[10\]"):
        masked_aggregate(torch.zeros(10), torch.ones(10), "token_mean")

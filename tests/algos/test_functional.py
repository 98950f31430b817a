import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolefleet.algos.functional import check_inputs, masked_mean, masked_sum, masked_var, masked_whiten, upcast
from tests.algos.edge import (
    FAST,
    FULL,
    GARBAGE,
    GARBAGE_VALUES,
    REWARD,
    Case,
    check_all_masked,
    check_case,
    masks,
    tensor,
)


def _whiten_case(draw, mask):
    shift = draw(st.booleans())
    return Case(lambda x: masked_whiten(x["x"], x["mask"], shift_mean=shift), {"x": tensor(draw, REWARD, mask.shape)},
                mask, grad=("x",))


@FAST
@given(data=st.data(), mask=masks(), garbage=GARBAGE, dtype=FULL)
def test_masked_whiten_on_edge_inputs(data, mask, garbage, dtype):
    check_case(masked_whiten, _whiten_case(data.draw, mask), garbage, dtype)


@settings(FAST, max_examples=10)
@given(data=st.data(), mask=masks(all_masked=True))
def test_masked_whiten_on_an_all_masked_batch(data, mask):
    check_all_masked(_whiten_case(data.draw, mask))


@pytest.mark.parametrize("garbage", GARBAGE_VALUES)
def test_masked_reductions_never_read_masked_positions(garbage):
    # x * mask gave inf * 0 = NaN; selection does not look at the masked values at all.
    x = torch.tensor([[1.0, 2.0, garbage], [4.0, garbage, garbage]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    total = masked_sum(x, mask) + masked_mean(x, mask, dim=-1).sum() + masked_var(x, mask)
    total.backward()
    assert masked_sum(x, mask).item() == 7.0 and masked_mean(x, mask, dim=-1).tolist() == [1.5, 4.0]
    assert masked_var(x, mask).item() == pytest.approx(7 / 3)  # 1, 2, 4: mean 7/3, unbiased var 7/3
    assert torch.isfinite(x.grad).all() and x.grad[~mask.bool()].eq(0).all()


def test_check_inputs_names_the_argument():
    with pytest.raises(ValueError, match=r"^values is empty \(shape \(2, 0\)\)"):
        check_inputs(rewards=torch.zeros(2, 3), values=torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but rewards has shape \(2, 3\)"):
        check_inputs(rewards=torch.zeros(2, 3), mask=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"^rewards must be \[B, T\], got shape \(3,\)"):
        check_inputs(rewards=torch.zeros(3))
    check_inputs(rewards=torch.zeros(2, 3), weights=None)  # optional inputs may be absent


def test_upcast_widens_half_precision_only():
    assert [upcast(torch.zeros(1, dtype=d)).dtype for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] \
        == [torch.float32, torch.float32, torch.float32, torch.float64]
    assert math.isfinite(masked_mean(torch.zeros(0), torch.zeros(0)).item())  # internal helpers stay total

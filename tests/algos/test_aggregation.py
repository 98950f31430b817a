import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolefleet.algos import LOSS_AGGREGATIONS, aggregate
from tests.algos import refs
from tests.algos.conftest import pad
from tests.algos.edge import FAST, FULL, GARBAGE, REWARD, Case, check_all_masked, check_case, covered, masks, tensor


def _case(name):
    def build(draw, mask):
        norm = draw(st.sampled_from([None, 1, 5]))
        fn = LOSS_AGGREGATIONS.get(name)
        return Case(lambda x: fn(x["loss"], x["mask"], norm), {"loss": tensor(draw, REWARD, mask.shape)}, mask,
                    grad=("loss",))
    return build


CASES = {name: _case(name) for name in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                        "seq-mean-token-sum-norm")}


def test_every_aggregation_has_edge_cases():
    covered(CASES, LOSS_AGGREGATIONS.names())


@pytest.mark.parametrize("name", LOSS_AGGREGATIONS.names())
@FAST
@given(data=st.data(), mask=masks(), garbage=GARBAGE, dtype=FULL)
def test_aggregations_on_edge_inputs(name, data, mask, garbage, dtype):
    check_case(LOSS_AGGREGATIONS.get(name), CASES[name](data.draw, mask), garbage, dtype)


@pytest.mark.parametrize("name", LOSS_AGGREGATIONS.names())
@settings(FAST, max_examples=10)
@given(data=st.data(), mask=masks(all_masked=True))
def test_aggregations_on_an_all_masked_batch(name, data, mask):
    check_all_masked(CASES[name](data.draw, mask))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_a_row_without_tokens_is_not_counted(mode):
    # Row 1 has no tokens (e.g. the IS correction masked the whole response): it is not a response
    # of the batch. Before, seq-mean-token-sum and -norm divided by B = 3 instead of 2.
    rows = [[1.0, 2.0, 3.0], [4.0]]
    loss, mask = pad([rows[0], [], rows[1]], width=4)
    expected = refs.aggregate(rows, mode, norm_length=4)
    assert aggregate(loss, mask, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_packed_one_dim_loss_is_one_row(mode):
    loss = torch.tensor([1.0, 2.0, 6.0])
    assert aggregate(loss, torch.ones(3), mode, 3).item() == pytest.approx(aggregate(loss[None], torch.ones(1, 3), mode, 3).item())


def test_empty_batch_and_bad_norm_length_are_value_errors():
    with pytest.raises(ValueError, match="loss is empty"):
        aggregate(torch.zeros(0, 3), torch.zeros(0, 3), "token-mean")
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(torch.zeros(2, 3), torch.zeros(2, 4), "seq-mean-token-sum")
    with pytest.raises(ValueError, match="norm_length must be >= 1"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm", 0)

import pytest
import torch

from rolefleet.common.batch import SequenceBatch, mini_batches
from rolefleet.common.errors import InvalidArgument


def make_batch():
    return SequenceBatch.from_lists(
        [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])],
        [torch.tensor([7, 8, 9]), torch.tensor([10]), torch.tensor([11, 12])],
    )


def test_model_inputs_are_right_padded_prompt_plus_response():
    ids, mask = make_batch().model_inputs(pad_id=0)
    assert ids.tolist() == [[1, 2, 7, 8, 9], [3, 10, 0, 0, 0], [4, 5, 6, 11, 12]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_response_positions_point_at_the_predicting_position():
    batch = make_batch()
    ids, _ = batch.model_inputs()
    rows, cols = batch.response_positions()
    # The token after each position must be the packed response token it predicts.
    assert ids[rows, cols + 1].tolist() == batch.response_ids.tolist()


def test_packed_inputs_restart_positions_and_point_at_the_predicting_position():
    batch = make_batch()
    ids, positions = batch.packed_inputs()
    assert ids.tolist() == [[1, 2, 7, 8, 9, 3, 10, 4, 5, 6, 11, 12]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4]]
    assert ids[0, batch.packed_response_positions() + 1].tolist() == batch.response_ids.tolist()


def test_pad_and_pack_are_inverse():
    batch = make_batch()
    packed = torch.arange(6, dtype=torch.float32)
    padded = batch.pad_responses(packed, fill=-1)
    assert padded.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    assert batch.response_mask().tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert torch.equal(batch.pack_responses(padded), packed)


def test_select_and_token_index_agree():
    batch = make_batch()
    sub = batch.select([2, 0])
    assert sub.response_ids.tolist() == [11, 12, 7, 8, 9]
    assert batch.token_index(torch.tensor([2, 0])).tolist() == [4, 5, 0, 1, 2]


def test_proto_round_trip():
    batch = make_batch()
    back = SequenceBatch.from_proto(batch.to_proto())
    for name in ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths"):
        assert torch.equal(getattr(back, name), getattr(batch, name))


@pytest.mark.parametrize(
    "lists, field",
    [
        (([torch.tensor([1])], [torch.tensor([], dtype=torch.int64)]), "batch.response_lengths"),
        (([torch.tensor([-1])], [torch.tensor([2])]), "batch.prompt_ids"),
        (([], []), "batch.prompt_lengths"),
    ],
)
def test_validation_names_the_field(lists, field):
    with pytest.raises(InvalidArgument) as err:
        SequenceBatch.from_lists(*lists).validate()
    assert err.value.field == field


def test_inconsistent_lengths_are_rejected():
    batch = make_batch()
    bad = SequenceBatch(batch.prompt_ids[:-1], batch.prompt_lengths, batch.response_ids, batch.response_lengths)
    with pytest.raises(InvalidArgument, match="sum to"):
        bad.validate()
    with pytest.raises(InvalidArgument, match="vocab size"):
        batch.validate(vocab_size=10)


def test_per_token_tensors_must_match_the_batch():
    batch = make_batch()
    with pytest.raises(InvalidArgument, match="6 response tokens"):
        batch.check_per_token(torch.zeros(5), "advantages")
    with pytest.raises(InvalidArgument, match="NaN"):
        batch.check_per_token(torch.tensor([0, 0, 0, 0, 0, float("nan")]), "advantages")


def test_mini_batches_partition_the_batch():
    parts = mini_batches(7, 3, torch.Generator().manual_seed(0))
    assert len(parts) == 3
    assert sorted(torch.cat(parts).tolist()) == list(range(7))
    assert len(mini_batches(2, 5, torch.Generator())) == 2  # never an empty mini-batch


def test_lengths_that_overflow_int64_sums_are_rejected():
    # int64 sum wraps around: 2 + (2**63 - 1) * 2 + 2 "equals" 2 tokens
    huge = 2**63 - 1
    bad = SequenceBatch(torch.tensor([1, 2]), torch.tensor([2, huge, huge, 2]), torch.tensor([3, 4, 5, 6]),
                        torch.tensor([1, 1, 1, 1]))
    with pytest.raises(InvalidArgument) as err:
        bad.validate()
    assert err.value.field == "batch.prompt_ids"


def test_limits_are_checked_from_declared_sizes_before_decoding():
    from rolefleet.common.batch import BatchLimits
    from rolefleet.common.errors import LimitExceeded
    from rolefleet.common.pb import common_pb2

    limits = BatchLimits("critic", max_sequences=2, max_tokens=10)
    with pytest.raises(LimitExceeded, match="3 sequences exceed critic.max_sequences_per_request=2"):
        SequenceBatch.from_proto(make_batch().to_proto(), limits=limits)
    # A claimed 2**40 tokens with no bytes behind them: refused by the limit, nothing allocated.
    huge = common_pb2.SequenceBatch(prompt_ids=common_pb2.Tensor(dtype="int64", shape=[2**40]),
                                    prompt_lengths=make_batch().to_proto().prompt_lengths)
    with pytest.raises(LimitExceeded, match="critic.max_tokens_per_request=10") as err:
        SequenceBatch.from_proto(huge, limits=BatchLimits("critic", 8, 10))
    assert err.value.field == "batch.prompt_ids"
    ok = SequenceBatch.from_proto(make_batch().to_proto(), limits=BatchLimits("critic", 3, 12))
    assert len(ok) == 3


def test_check_limits_refuses_sequences_longer_than_the_model():
    from rolefleet.common.batch import BatchLimits

    batch = make_batch()  # longest sequence: 5 tokens
    batch.check_limits(BatchLimits("actor", 8, 100, max_positions=5))
    with pytest.raises(InvalidArgument, match="a 5-token sequence exceeds the model's 4 positions"):
        batch.check_limits(BatchLimits("actor", 8, 100, max_positions=4))


def test_micro_batches_for_workers_come_in_a_multiple_of_their_count():
    """Shared by two workers: the largest groups are halved until every worker gets as many, each
    within the budget and every row once; single rows cannot be split further."""
    batch = SequenceBatch.from_lists([torch.tensor([1, 2])] * 6, [torch.arange(n + 1) for n in range(6)])
    one = batch.micro_batches(1000)
    assert len(one) == 1
    for workers in (2, 3, 4):
        groups = batch.micro_batches(1000, multiple_of=workers)
        assert len(groups) % workers == 0
        assert sorted(torch.cat(groups).tolist()) == list(range(6))
    odd = batch.micro_batches(24)  # padded rows x longest within 24: groups of uneven count
    even = batch.micro_batches(24, multiple_of=2)
    assert len(even) % 2 == 0 and len(even) >= len(odd)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    assert all(len(g) * max(lengths[i] for i in g.tolist()) <= 24 for g in even)
    single = SequenceBatch.from_lists([torch.tensor([1])] * 3, [torch.tensor([2])] * 3)
    assert len(single.micro_batches(2, multiple_of=2)) == 3  # one row each: left as they are

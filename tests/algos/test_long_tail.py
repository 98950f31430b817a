"""The long tail's maths: DAPO's soft overlong penalty and the informative-group filter of dynamic
sampling, against hand-computed cases and a float64 reference."""

import pytest
import torch

from rolefleet.algos import OVERLONG, informative_groups
from rolefleet.algos.long_tail import soft_overlong_penalty


def test_the_soft_penalty_by_hand():
    # cap 10, buffer 4: free up to 6 tokens, then -1/4 a token to -1 at the cap (and past it)
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 12])
    assert soft_overlong_penalty(lengths, max_len=10, buffer=4).tolist() == [0, 0, -0.25, -0.5, -0.75, -1, -1]


def test_the_soft_penalty_against_a_float64_reference():
    lengths = torch.randint(0, 600, (1000,), generator=torch.Generator().manual_seed(0))
    cap, buffer = 512, 128
    ref = [0.0 if n <= cap - buffer else ((cap - buffer) - n) / buffer if n <= cap else -1.0 for n in lengths.tolist()]
    got = soft_overlong_penalty(lengths, cap, buffer)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6)


def test_overlong_modes_through_the_registry():
    scores, lengths = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3, 9, 10])
    truncated = torch.tensor([False, False, True])
    given = dict(scores=scores, lengths=lengths, truncated=truncated, max_len=10, buffer=2)
    shaped, keep = OVERLONG.call("none", **given)
    assert torch.equal(shaped, scores) and keep.tolist() == [True, True, True]
    shaped, keep = OVERLONG.call("penalty", **given, factor=0.5)
    assert shaped.tolist() == [1.0, -0.25, 0.5] and keep.all()
    shaped, keep = OVERLONG.call("filter", **given)  # the scores stay, for the group's statistics
    assert torch.equal(shaped, scores) and keep.tolist() == [True, True, False]
    with pytest.raises(KeyError, match="valid: filter, none, penalty"):
        OVERLONG.get("clip")


@pytest.mark.parametrize("buffer", [0, -1, 11])
def test_the_penalty_refuses_a_buffer_outside_the_cap(buffer):
    with pytest.raises(ValueError, match="overlong buffer"):
        soft_overlong_penalty(torch.tensor([5]), max_len=10, buffer=buffer)


def test_groups_whose_scores_all_match_carry_no_signal():
    groups = torch.tensor([7, 7, 3, 3, 3, 9, 4, 4])
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 5.0, 0.2, 0.2 + 1e-8])
    assert informative_groups(scores, groups).tolist() == [False, False, True, True, True, False, False, False]
    # A wider tolerance merges near scores; a group of one never differs.
    assert informative_groups(torch.tensor([0.0, 0.05]), torch.tensor([1, 1]), tolerance=0.1).tolist() == [False, False]
    assert informative_groups(torch.tensor([0.0, 0.05]), torch.tensor([1, 1])).tolist() == [True, True]

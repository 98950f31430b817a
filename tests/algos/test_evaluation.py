"""pass@k against the binomial formula in exact arithmetic, and its edges."""

import itertools
import math
from fractions import Fraction

import pytest
import torch

from rolefleet.algos import pass_at_k


def reference(correct: list[list[bool]], k: int) -> float:
    """1 - C(n - c, k) / C(n, k) per prompt, averaged, as exact fractions."""
    n = len(correct[0])
    return float(sum(1 - Fraction(math.comb(n - sum(row), k), math.comb(n, k)) for row in correct) / len(correct))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_the_binomial_formula(n):
    rows = [list(bits) for bits in itertools.product([False, True], repeat=n)][:32]
    correct = torch.tensor(rows)
    for k in range(1, n + 1):
        assert pass_at_k(correct, k).item() == pytest.approx(reference(rows, k), abs=1e-12)


def test_pass_at_k_by_hand():
    correct = torch.tensor([[True, False, False, False], [False] * 4, [True] * 4])
    assert pass_at_k(correct, 1).item() == pytest.approx((0.25 + 0 + 1) / 3)
    assert pass_at_k(correct, 2).item() == pytest.approx((0.5 + 0 + 1) / 3)   # 1 - C(3,2)/C(4,2) = 1/2
    assert pass_at_k(correct, 4).item() == pytest.approx((1 + 0 + 1) / 3)


def test_pass_at_k_does_not_overflow_at_large_n():
    correct = torch.zeros(2, 2000, dtype=torch.bool)
    correct[0, :3] = True
    value = pass_at_k(correct, 1000).item()
    assert math.isfinite(value) and value == pytest.approx((1 - (1000 * 999 * 998) / (2000 * 1999 * 1998)) / 2, rel=1e-9)


@pytest.mark.parametrize("shape, k", [((0, 4), 1), ((3,), 1), ((2, 4), 0), ((2, 4), 5)])
def test_pass_at_k_refuses_bad_shapes_and_k(shape, k):
    with pytest.raises(ValueError):
        pass_at_k(torch.zeros(shape, dtype=torch.bool), k)

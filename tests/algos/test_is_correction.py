import math

import pytest
import torch

from rolefleet.algos import IS_CORRECTIONS, logprob_mismatch
from tests.algos.conftest import pad

# Per-token log(pi_old / pi_rollout): weights e^1, e^-0.1, 1 in response 0; e^0.2, e^0.2 in response 1
OLD, MASK = pad([[1.0, -0.1, 0.0], [0.2, 0.2]], width=4, fill=50.0)
ROLLOUT = torch.zeros_like(OLD)


def test_none_keeps_everything():
    w, mask = IS_CORRECTIONS.get("none")(OLD, ROLLOUT, MASK, 2.0)
    assert torch.all(w == 1) and torch.equal(mask, MASK)


def test_token_truncate():
    w, mask = IS_CORRECTIONS.get("token_truncate")(OLD, ROLLOUT, MASK, 2.0)
    expected = [[2.0, math.exp(-0.1), 1.0, 0.0], [math.exp(0.2), math.exp(0.2), 0.0, 0.0]]
    assert torch.allclose(w, torch.tensor(expected, dtype=w.dtype))
    assert torch.equal(mask, MASK)


def test_token_mask_drops_tokens_outside_the_bounds():
    w, mask = IS_CORRECTIONS.get("token_mask")(OLD, ROLLOUT, MASK, 2.0)
    assert mask.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert w[0, 0].item() == 0.0 and w[1, 0].item() == pytest.approx(math.exp(0.2))


def test_sequence_level_weights_are_the_product_over_the_response():
    w, mask = IS_CORRECTIONS.get("seq_truncate")(OLD, ROLLOUT, MASK, 2.0)
    # response 0: e^(1 - 0.1) = 2.46 -> truncated to 2; response 1: e^0.4 = 1.49
    assert w[0, :3].tolist() == pytest.approx([2.0] * 3) and w[1, :2].tolist() == pytest.approx([math.exp(0.4)] * 2)
    assert w[0, 3].item() == 0.0 and torch.equal(mask, MASK)
    w, mask = IS_CORRECTIONS.get("seq_mask")(OLD, ROLLOUT, MASK, 2.0)
    assert mask.tolist() == [[False] * 4, [True, True, False, False]]


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_()
    for name in IS_CORRECTIONS.names():
        w, _ = IS_CORRECTIONS.get(name)(old, ROLLOUT, MASK, 2.0)
        assert not w.requires_grad


def test_loop_reference_for_token_truncate():
    g = torch.Generator().manual_seed(3)
    old, rollout = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) > 0.3
    w, _ = IS_CORRECTIONS.get("token_truncate")(old, rollout, mask, 1.5)
    for i in range(5):
        for j in range(7):
            expected = min(math.exp(old[i, j] - rollout[i, j]), 1.5) if mask[i, j] else 0.0
            assert w[i, j].item() == pytest.approx(expected)


def test_mismatch_metric():
    mean, top = logprob_mismatch(torch.tensor([[0.0, -1.0, 9.0]]), torch.tensor([[0.5, -1.0, 0.0]]),
                                 torch.tensor([[1, 1, 0]]))
    assert mean.item() == pytest.approx(0.25) and top.item() == pytest.approx(0.5)

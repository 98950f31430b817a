import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolefleet.algos import IS_CORRECTIONS, logprob_mismatch
from rolefleet.algos.is_correction import MAX_LOG_WEIGHT
from tests.algos.conftest import pad
from tests.algos.edge import (
    FAST,
    FULL,
    GARBAGE,
    LOG_RATIO,
    LOGPROB,
    Case,
    check_all_masked,
    check_case,
    covered,
    masks,
    tensor,
)

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


# --- edge inputs (property-based) ---------------------------------------------------------------------

def _correction_case(name):
    def build(draw, mask):
        fn, threshold = IS_CORRECTIONS.get(name), draw(st.sampled_from([1.0, 1.5, 2.0, 1e3, math.inf]))
        old = tensor(draw, LOGPROB, mask.shape)
        # "none" returns weights of 1 everywhere: its all-masked result is ones, not zeros.
        return Case(lambda x: fn(x["old_logprobs"], x["rollout_logprobs"], x["mask"], threshold),
                    {"old_logprobs": old, "rollout_logprobs": old - tensor(draw, LOG_RATIO, mask.shape)}, mask,
                    zero_when_masked=name != "none")
    return build


def _mismatch_case(draw, mask):
    lp = tensor(draw, LOGPROB, mask.shape)
    return Case(lambda x: logprob_mismatch(x["logprobs"], x["other"], x["mask"]),
                {"logprobs": lp, "other": lp - tensor(draw, LOG_RATIO, mask.shape)}, mask, grad=("logprobs",))


CORRECTION_CASES = {name: _correction_case(name)
                    for name in ("none", "token_truncate", "token_mask", "seq_truncate", "seq_mask")}
CASES = {**{(IS_CORRECTIONS.get(n), n): c for n, c in CORRECTION_CASES.items()},
         (logprob_mismatch, "logprob_mismatch"): _mismatch_case}
CASE_IDS = [name for _, name in CASES]


def test_every_correction_has_edge_cases():
    covered(CORRECTION_CASES, IS_CORRECTIONS.names())


@pytest.mark.parametrize("fn, name", list(CASES), ids=CASE_IDS)
@FAST
@given(data=st.data(), mask=masks(), garbage=GARBAGE, dtype=FULL)
def test_corrections_on_edge_inputs(fn, name, data, mask, garbage, dtype):
    case = CASES[fn, name](data.draw, mask)
    check_case(fn, case, garbage, dtype)
    if name != "logprob_mismatch":
        weights, kept = fn(*case.tensors.values(), mask, 2.0)
        assert torch.all(weights >= 0) and torch.all(weights <= math.exp(MAX_LOG_WEIGHT))
        assert not (kept.bool() & ~mask).any()  # a correction only ever drops tokens


@pytest.mark.parametrize("fn, name", list(CASES), ids=CASE_IDS)
@settings(FAST, max_examples=10)
@given(data=st.data(), mask=masks(all_masked=True))
def test_corrections_on_an_all_masked_batch(fn, name, data, mask):
    check_all_masked(CASES[fn, name](data.draw, mask))


@pytest.mark.parametrize("name", ["token_mask", "seq_mask"])
def test_masking_decisions_are_exact_beyond_the_weight_bound(name):
    # Sequence log-weights 120 and -120: exp overflowed to inf (and underflowed to 0); weights of
    # rejected tokens are 0, never inf * 0 = NaN.
    old = torch.tensor([[40.0, 40.0, 40.0], [-40.0, -40.0, -40.0], [0.1, 0.0, 0.0]])
    weights, kept = IS_CORRECTIONS.get(name)(old, torch.zeros(3, 3), torch.ones(3, 3), 2.0)
    assert kept[:2].sum() == 0 and torch.all(weights[:2] == 0) and torch.isfinite(weights).all()
    assert kept[2].tolist() == [1.0, 1.0, 1.0]


def test_truncated_sequence_weight_is_finite_and_capped():
    old = torch.full((1, 3), 40.0)
    weights, _ = IS_CORRECTIONS.get("seq_truncate")(old, torch.zeros(1, 3), torch.ones(1, 3), math.inf)
    assert weights[0].tolist() == pytest.approx([math.exp(MAX_LOG_WEIGHT)] * 3)


def test_corrections_reject_empty_input_and_bad_thresholds_by_name():
    for name in IS_CORRECTIONS.names():
        with pytest.raises(ValueError, match="old_logprobs is empty"):
            IS_CORRECTIONS.get(name)(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), 2.0)
    with pytest.raises(ValueError, match="threshold must be >= 1"):
        IS_CORRECTIONS.get("token_mask")(OLD, ROLLOUT, MASK, 0.5)
    with pytest.raises(ValueError, match="other has shape"):
        logprob_mismatch(torch.zeros(3), torch.zeros(4), torch.ones(3))

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolefleet.algos import (
    IS_CORRECTIONS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    VALUE_LOSSES,
    aggregate,
    entropy_from_logits,
)
from rolefleet.algos.losses import GSPO_MAX_SEQ_LOG_RATIO, MAX_LOG_RATIO
from tests.algos import refs
from tests.algos.conftest import pad
from tests.algos.edge import (
    FAST,
    FULL,
    GARBAGE,
    LOG_RATIO,
    LOGPROB,
    REWARD,
    WEIGHT,
    Case,
    check_all_masked,
    check_case,
    covered,
    masks,
    tensor,
)

ppo = POLICY_LOSSES.get("ppo_clip")
gspo = POLICY_LOSSES.get("gspo")
value_loss = VALUE_LOSSES.get("clipped_mse")
ONE = torch.ones(1, 3)


def row(*xs):
    return torch.tensor([list(xs)], dtype=torch.float64)


# --- PPO clip -----------------------------------------------------------------------------------------

def test_ppo_clip_hand_computed():
    # ratios 1.5 (A=+1 -> clipped at 1.2), 0.5 (A=+1 -> unclipped 0.5), 0.5 (A=-1 -> clipped at 0.8)
    new = torch.log(row(1.5, 0.5, 0.5))
    loss, stats = ppo(new, torch.zeros_like(new), row(1.0, 1.0, -1.0), ONE, clip_low=0.2, clip_high=0.2)
    # per token: max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_sft_is_the_mean_negative_log_likelihood_of_the_trained_tokens():
    """Old logprobs and advantages do not enter; padding and masked tokens count nothing; the
    gradient of each trained token's logprob is -1 / (trained tokens) under token-mean."""
    sft = POLICY_LOSSES.get("sft")
    lp = torch.tensor([[-0.5, -2.0, -9.0], [-1.0, -3.0, -7.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, stats = sft(lp, torch.full_like(lp, 5.0), torch.full_like(lp, -3.0), mask)
    assert loss.item() == pytest.approx((0.5 + 2.0 + 1.0) / 3) and stats["nll"].item() == pytest.approx(3.5 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]], dtype=torch.float64))
    per_sequence, _ = sft(lp.detach(), lp.detach(), lp.detach(), mask, agg="seq-mean-token-mean")
    assert per_sequence.item() == pytest.approx(((0.5 + 2.0) / 2 + 1.0) / 2)
    with pytest.raises(ValueError, match="dual_clip"):
        sft(lp, lp, lp, mask, dual_clip=2.0)


def test_clip_higher_is_asymmetric():
    new = torch.log(row(1.25, 1.25))
    loss, _ = ppo(new, torch.zeros_like(new), row(1.0, 1.0), torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25)  # 1.25 < 1 + 0.28: not clipped above
    loss, _ = ppo(torch.log(row(0.7)), torch.zeros(1, 1), row(-1.0), torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(0.8)  # 0.7 < 1 - 0.2: clipped below as usual


def test_dual_clip_caps_negative_advantage_loss():
    new = torch.log(row(5.0, 5.0))
    adv = row(-1.0, 1.0)
    loss, stats = ppo(new, torch.zeros_like(new), adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # A<0: max(5, 1.2) = 5 capped at 3; A>0: max(-5, -1.2) = -1.2 (dual clip does not apply)
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(0.5)
    new = new.clone().requires_grad_()
    loss, _ = ppo(new, torch.zeros_like(new), adv, torch.ones(1, 2), dual_clip=3.0)
    loss.backward()
    assert new.grad[0, 0].item() == 0.0  # the capped token pushes nothing


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("clip_high, dual", [(0.2, None), (0.28, 3.0)])
def test_ppo_clip_matches_float64_reference(agg, clip_high, dual):
    g = torch.Generator().manual_seed(1)
    lengths = [4, 1, 6, 3]
    new_rows = [(torch.randn(n, generator=g, dtype=torch.float64) * 0.4).tolist() for n in lengths]
    old_rows = [(torch.randn(n, generator=g, dtype=torch.float64) * 0.4).tolist() for n in lengths]
    adv_rows = [torch.randn(n, generator=g, dtype=torch.float64).tolist() for n in lengths]
    ref_rows = []
    for new, old, adv in zip(new_rows, old_rows, adv_rows):
        out = []
        for lp, olp, a in zip(new, old, adv):
            r = math.exp(lp - olp)
            x = max(-a * r, -a * min(max(r, 0.8), 1 + clip_high))
            if dual is not None and a < 0:
                x = min(x, -a * dual)
            out.append(x)
        ref_rows.append(out)
    new, mask = pad(new_rows, width=8, fill=9.0)
    old, _ = pad(old_rows, width=8, fill=-9.0)
    adv, _ = pad(adv_rows, width=8, fill=5.0)
    loss, _ = ppo(new, old, adv, mask, clip_low=0.2, clip_high=clip_high, dual_clip=dual, agg=agg, norm_length=10)
    assert loss.item() == pytest.approx(refs.aggregate(ref_rows, agg, norm_length=10))


def test_clipped_region_has_zero_gradient():
    new = torch.log(row(1.5, 0.9)).requires_grad_()
    loss, _ = ppo(new, torch.zeros_like(new), row(1.0, 1.0), torch.ones(1, 2))
    loss.backward()
    assert new.grad[0, 0].item() == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped, no push further
    assert new.grad[0, 1].item() == pytest.approx(-0.9 / 2)  # d(-A r)/dlogp = -A r, token-mean over 2


def test_importance_weights_scale_each_token():
    new = torch.log(row(1.0, 1.0))
    loss, _ = ppo(new, torch.zeros_like(new), row(1.0, 1.0), torch.ones(1, 2), weights=row(0.5, 2.0))
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)


# --- GSPO ---------------------------------------------------------------------------------------------

def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    # log-ratios 0.2 and 0.0 -> s = exp(0.1) for every token; clip range 0.3 leaves it unclipped
    new, old = row(0.2, 0.0), torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = gspo(new, old, row(1.0, 1.0), torch.ones(1, 2), clip_low=0.3, clip_high=0.3)
    assert loss.item() == pytest.approx(-math.exp(0.1))
    new = new.clone().requires_grad_()
    loss, _ = gspo(new, old, row(1.0, 1.0), torch.ones(1, 2), clip_low=0.3, clip_high=0.3)
    loss.backward()
    # d/dlogp_t of -A * sg(s) * pi_t/sg(pi_t), seq-mean-token-mean over 2 tokens: -s / 2 each
    assert new.grad.tolist()[0] == pytest.approx([-math.exp(0.1) / 2] * 2)


def test_gspo_clips_the_sequence_ratio_and_ignores_padding():
    new, mask = pad([[0.5, 0.5], [0.0]], width=4, fill=7.0)
    loss, stats = gspo(new, torch.zeros_like(new), torch.ones_like(new), mask, clip_low=3e-4, clip_high=4e-4)
    # seq 0: s = e^0.5 clipped to 1.0004 -> -1.0004; seq 1: s = 1 -> -1
    assert loss.item() == pytest.approx((-1.0004 - 1.0) / 2)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        gspo(new, new, new, mask, dual_clip=3.0)


# --- value loss, aggregation, entropy ----------------------------------------------------------------

def test_value_loss_hand_computed_and_clipping():
    values, old, returns = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0])
    loss, stats = value_loss(values, old, returns, torch.ones(2), value_clip=0.5)
    # token 0: unclipped (1-0)^2=1, clipped (0.5-0)^2=0.25 -> 1; token 1: (0-1)^2 both -> 1
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert stats["vf_clipfrac"].item() == 0.0
    values = torch.tensor([1.0]).requires_grad_()
    loss, stats = value_loss(values, torch.tensor([0.0]), torch.tensor([2.0]), torch.ones(1), value_clip=0.5)
    assert stats["vf_clipfrac"].item() == 1.0  # clipped 0.5 is further from 2 than 1 is
    loss.backward()
    assert values.grad.item() == 0.0


def test_aggregations_hand_computed():
    loss, mask = pad([[1.0, 2.0, 3.0], [4.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(10 / (2 * 5))
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    with pytest.raises(KeyError, match="valid: seq-mean-token-mean"):
        aggregate(loss, mask, "mean")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_unchanged_by_extra_padding(agg):
    rows = [[1.0, -2.0], [0.5, 0.5, 3.0], [7.0]]
    narrow, m1 = pad(rows)
    wide, m2 = pad(rows, width=10, fill=1e9)
    assert aggregate(narrow, m1, agg).item() == pytest.approx(aggregate(wide, m2, agg).item())


def test_entropy_from_logits():
    uniform = torch.zeros(2, 4)
    assert entropy_from_logits(uniform).tolist() == pytest.approx([math.log(4)] * 2)
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert entropy_from_logits(p.log()[None]).item() == pytest.approx(-(p * p.log()).sum().item())


# --- edge inputs (property-based) ---------------------------------------------------------------------

CLIPS = [(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)]


def _policy_case(fn, dual_clips):
    def build(draw, mask):
        lp = tensor(draw, LOGPROB, mask.shape)
        tensors = {"logprobs": lp, "old_logprobs": lp - tensor(draw, LOG_RATIO, mask.shape),
                   "advantages": tensor(draw, REWARD, mask.shape)}
        if draw(st.booleans()):
            tensors["weights"] = tensor(draw, WEIGHT, mask.shape)
        (low, high), dual = draw(st.sampled_from(CLIPS)), draw(st.sampled_from(dual_clips))
        agg, norm = draw(st.sampled_from(LOSS_AGGREGATIONS.names())), draw(st.sampled_from([None, 1, 7]))
        return Case(lambda x: fn(x["logprobs"], x["old_logprobs"], x["advantages"], x["mask"], clip_low=low,
                                 clip_high=high, dual_clip=dual, agg=agg, weights=x.get("weights"), norm_length=norm),
                    tensors, mask, grad=("logprobs",))
    return build


def _value_case(draw, mask):
    clip, agg = draw(st.sampled_from([0.0, 0.2, 1e3])), draw(st.sampled_from(LOSS_AGGREGATIONS.names()))
    tensors = {name: tensor(draw, REWARD, mask.shape) for name in ("values", "old_values", "returns")}
    return Case(lambda x: value_loss(x["values"], x["old_values"], x["returns"], x["mask"], clip, agg=agg),
                tensors, mask, grad=("values",))


POLICY_CASES = {"ppo_clip": _policy_case(ppo, [None, 1.5, 3.0]), "gspo": _policy_case(gspo, [None]),
                "sft": _policy_case(POLICY_LOSSES.get("sft"), [None])}
VALUE_CASES = {"clipped_mse": _value_case}
CASES = {**{(POLICY_LOSSES, n): c for n, c in POLICY_CASES.items()},
         **{(VALUE_LOSSES, n): c for n, c in VALUE_CASES.items()}}
CASE_IDS = [name for _, name in CASES]


def test_every_loss_has_edge_cases():
    covered(POLICY_CASES, POLICY_LOSSES.names())
    covered(VALUE_CASES, VALUE_LOSSES.names())


@pytest.mark.parametrize("registry, name", list(CASES), ids=CASE_IDS)
@FAST
@given(data=st.data(), mask=masks(), garbage=GARBAGE, dtype=FULL)
def test_losses_on_edge_inputs(registry, name, data, mask, garbage, dtype):
    check_case(registry.get(name), CASES[registry, name](data.draw, mask), garbage, dtype)


@pytest.mark.parametrize("registry, name", list(CASES), ids=CASE_IDS)
@settings(FAST, max_examples=10)
@given(data=st.data(), mask=masks(all_masked=True))
def test_losses_on_an_all_masked_batch(registry, name, data, mask):
    check_all_masked(CASES[registry, name](data.draw, mask))


@pytest.mark.parametrize("log_ratio", [-99.0, 99.0, -1e4])
@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
def test_extreme_log_ratio_with_zero_advantage_is_finite(name, log_ratio):
    # All-equal GRPO groups give A = 0; exp(99) is inf in float32 and inf * 0 = NaN.
    new = torch.tensor([[log_ratio, 0.0]], requires_grad=True)
    loss, stats = POLICY_LOSSES.get(name)(new, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(new.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())


def test_ppo_ratio_is_bounded_with_no_gradient_beyond_the_bound():
    # A < 0 keeps the unclipped branch -A r, so the bound is what the loss sees.
    new = torch.tensor([[MAX_LOG_RATIO + 5.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = ppo(new, torch.zeros(1, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(MAX_LOG_RATIO)) and new.grad.item() == 0.0


def test_gspo_sequence_ratio_is_bounded_on_both_sides():
    for sign in (1.0, -1.0):
        new = torch.full((1, 3), sign * (GSPO_MAX_SEQ_LOG_RATIO + 3.0), dtype=torch.float64, requires_grad=True)
        loss, _ = gspo(new, torch.zeros_like(new), -torch.ones_like(new), torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
        loss.backward()
        # A = -1: the loss is max(r, clip(r)); beyond the bound r is the constant e^(+-10).
        expected = max(math.exp(sign * GSPO_MAX_SEQ_LOG_RATIO), 0.8)
        assert loss.item() == pytest.approx(expected) and torch.all(new.grad == 0)


@pytest.mark.parametrize("name", ["token_mask", "seq_mask", "seq_truncate"])
def test_is_weights_of_rejected_sequences_keep_the_policy_loss_finite(name):
    # Summed log-ratio 3 x 40 = 120 > 88: exp overflowed float32, and the masked inf * 0 was NaN.
    old, mask = torch.full((2, 3), -1.0), torch.ones(2, 3)
    rollout = old.clone()
    rollout[0] -= 40.0
    weights, kept = IS_CORRECTIONS.get(name)(old, rollout, mask, 2.0)
    new = old.clone().requires_grad_()
    loss, _ = ppo(new, old, torch.ones(2, 3), kept, weights=weights)
    loss.backward()
    assert torch.isfinite(weights).all() and torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert loss.item() == pytest.approx(-1.0 if name != "seq_truncate" else -(2.0 * 3 + 3) / 6)


def test_policy_losses_reject_empty_and_mismatched_input_by_name():
    with pytest.raises(ValueError, match="logprobs is empty"):
        ppo(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), torch.ones(0, 3))
    with pytest.raises(ValueError, match="weights has shape"):
        gspo(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), weights=torch.ones(2, 4))
    with pytest.raises(ValueError, match="returns is empty"):
        value_loss(torch.zeros(2), torch.zeros(2), torch.zeros(0), torch.ones(2), value_clip=0.2)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), dual_clip=0.5)


def test_bf16_inputs_give_a_float32_loss():
    new = torch.full((4, 300), -1.0, dtype=torch.bfloat16, requires_grad=True)
    adv = torch.ones(4, 300, dtype=torch.bfloat16)
    adv[0, 0] = 2.0
    loss, stats = ppo(new, new.detach(), adv, torch.ones(4, 300), agg="seq-mean-token-sum")
    loss.backward()
    # (4 x 300 + 1) / 4 = 300.25: bf16 holds 300 or 302 there, float32 holds it exactly.
    assert loss.dtype == torch.float32 and loss.item() == -300.25 and new.grad.dtype == torch.bfloat16


# --- entropy ------------------------------------------------------------------------------------------

EXTREME_LOGIT = st.one_of(st.floats(-10.0, 10.0, width=32), st.floats(-(2.0 ** 127), 2.0 ** 127, width=32),
                          st.just(-math.inf))


@FAST
@given(data=st.data(), rows=st.integers(1, 4), vocab=st.integers(1, 12),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_entropy_is_finite_and_bounded_for_masked_and_extreme_logits(data, rows, vocab, dtype):
    logits = tensor(data.draw, EXTREME_LOGIT, (rows, vocab), dtype).requires_grad_()
    h = entropy_from_logits(logits)
    h.sum().backward()
    assert h.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    assert torch.isfinite(h).all() and torch.isfinite(logits.grad).all()
    alive = (logits > -math.inf).sum(-1).clamp(min=1)
    assert torch.all(h >= -1e-5) and torch.all(h <= alive.to(h.dtype).log() + 1e-4)


def test_entropy_with_a_masked_vocabulary():
    logits = torch.tensor([[0.0, 0.0, -math.inf, -math.inf], [-math.inf] * 4], requires_grad=True)
    h = entropy_from_logits(logits)
    h.sum().backward()
    # Two live tokens: log 2; a row with no live token has no distribution: 0.
    assert h.tolist() == pytest.approx([math.log(2), 0.0]) and torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="logits is empty"):
        entropy_from_logits(torch.zeros(0, 5))

import math

import pytest
import torch

from rolefleet.algos import LOSS_AGGREGATIONS, POLICY_LOSSES, VALUE_LOSSES, aggregate, entropy_from_logits
from tests.algos import refs
from tests.algos.conftest import pad

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

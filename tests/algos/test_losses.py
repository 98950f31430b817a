import math

import pytest
import torch

from rolefleet.algos import KL_ESTIMATORS, POLICY_LOSSES, VALUE_LOSSES

ppo = POLICY_LOSSES.get("ppo_clip")
value_loss = VALUE_LOSSES.get("clipped_mse")


def test_ppo_clip_hand_computed():
    # ratios 1.5 (A=+1 -> clipped at 1.2), 0.5 (A=+1 -> unclipped 0.5), 0.5 (A=-1 -> clipped at 0.8)
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = ppo(new, old, adv, torch.ones(3), clip_ratio=0.2)
    # per token: max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_ppo_clip_matches_float64_reference_and_honours_mask():
    torch.manual_seed(0)
    new, old, adv = torch.randn(4, 6, dtype=torch.float64) * 0.3, torch.randn(4, 6, dtype=torch.float64) * 0.3, torch.randn(4, 6, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.3
    total, count = 0.0, 0
    for i in range(4):
        for j in range(6):
            if mask[i, j]:
                r = math.exp(new[i, j] - old[i, j])
                total += max(-adv[i, j] * r, -adv[i, j] * min(max(r, 0.8), 1.2))
                count += 1
    loss, _ = ppo(new, old, adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx(total / count)


def test_clipped_region_has_zero_gradient():
    new = torch.log(torch.tensor([1.5, 0.9])).requires_grad_()
    loss, _ = ppo(new, torch.zeros(2), torch.tensor([1.0, 1.0]), torch.ones(2), clip_ratio=0.2)
    loss.backward()
    assert new.grad[0].item() == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped, no push further
    assert new.grad[1].item() == pytest.approx(-0.9 / 2)  # d(-A r)/dlogp = -A r, token-mean over 2


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


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators_against_reference(name):
    logp = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-0.7, -1.0, -1.5], dtype=torch.float64)
    expected = {
        "k1": [0.2, 0.0, -0.5],
        "k2": [0.02, 0.0, 0.125],
        "k3": [math.exp(-0.2) - 1 + 0.2, 0.0, math.exp(0.5) - 1 - 0.5],
    }[name]
    assert KL_ESTIMATORS.get(name)(logp, ref).tolist() == pytest.approx(expected)


def test_k3_is_non_negative_and_unbiased_for_kl():
    # Sampling from p, E_p[k3] = KL(p || q).
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = (p * (p / q).log()).sum()
    k3 = KL_ESTIMATORS.get("k3")(p.log(), q.log())
    assert torch.all(k3 >= 0)
    assert (p * k3).sum().item() == pytest.approx(exact.item())

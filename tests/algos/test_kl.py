import math

import pytest
import torch

from rolefleet.algos import KL_CONTROLLERS, KL_ESTIMATORS


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


def test_k1_and_k3_are_unbiased_and_k3_non_negative():
    # Sampling tokens from p, E_p[k1] = E_p[k3] = KL(p || q).
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = (p * (p / q).log()).sum().item()
    for name in ("k1", "k3"):
        assert (p * KL_ESTIMATORS.get(name)(p.log(), q.log())).sum().item() == pytest.approx(exact)
    assert torch.all(KL_ESTIMATORS.get("k3")(p.log(), q.log()) >= 0)


def test_k3_gradient_is_zero_at_the_reference():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    KL_ESTIMATORS.get("k3")(logp, logp.detach()).sum().backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_fixed_controller_keeps_the_coefficient():
    assert KL_CONTROLLERS.get("fixed")(0.05, current_kl=10.0, target=0.1, horizon=100, n_steps=64) == 0.05


def test_adaptive_controller_hand_computed_and_clipped():
    adaptive = KL_CONTROLLERS.get("adaptive")
    # error = 0.12 / 0.1 - 1 = 0.2; coef * (1 + 0.2 * 50 / 1000)
    assert adaptive(0.1, current_kl=0.12, target=0.1, horizon=1000, n_steps=50) == pytest.approx(0.1 * 1.01)
    # a KL far above target is clipped to +20% error
    assert adaptive(0.1, current_kl=5.0, target=0.1, horizon=1000, n_steps=50) == pytest.approx(0.1 * 1.01)
    # below target the coefficient shrinks
    assert adaptive(0.1, current_kl=0.0, target=0.1, horizon=1000, n_steps=50) == pytest.approx(0.1 * 0.99)


def test_adaptive_controller_tracks_the_target():
    coef, kl_per_coef = 1.0, 0.05  # a toy world where the observed KL falls as the coefficient grows
    for _ in range(400):
        coef = KL_CONTROLLERS.get("adaptive")(coef, kl_per_coef / coef, target=0.1, horizon=1000, n_steps=100)
    assert kl_per_coef / coef == pytest.approx(0.1, rel=0.05)

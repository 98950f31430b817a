import pytest
import torch

from rolefleet.algos import ADVANTAGE_ESTIMATORS
from rolefleet.algos.advantages import gae
from rolefleet.algos.functional import masked_mean, masked_whiten


def gae_reference(rewards, values, gamma, lam):
    """Independent float64 loop over one unpadded response."""
    rewards = [float(r) for r in rewards]
    values = [float(v) for v in values] + [0.0]
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * values[t + 1] - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values[:-1])]


def test_gae_hand_computed():
    # T=2, gamma=1, lam=0.5: delta1 = 1 - 0.5 = 0.5; delta0 = 0 + 0.5 - 0.25 = 0.25; A0 = 0.25 + 0.5*0.5
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.25, 0.5]]), torch.ones(1, 2), gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5]]))
    assert torch.allclose(ret, torch.tensor([[0.75, 1.0]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_float64_reference_per_row_and_ignores_padding(gamma, lam):
    torch.manual_seed(0)
    lengths = [5, 1, 3]
    rewards = torch.randn(3, 5, dtype=torch.float64)
    values = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    # Garbage in the padding must not change anything.
    rewards_noisy = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    values_noisy = torch.where(mask, values, torch.full_like(values, -1e6))
    adv, ret = gae(rewards_noisy, values_noisy, mask, gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        ref_adv, ref_ret = gae_reference(rewards[i, :n], values[i, :n], gamma, lam)
        assert torch.allclose(adv[i, :n], torch.tensor(ref_adv, dtype=torch.float64))
        assert torch.allclose(ret[i, :n], torch.tensor(ref_ret, dtype=torch.float64))
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_gae_unchanged_by_extra_padding_columns():
    torch.manual_seed(1)
    r, v, m = torch.randn(2, 4), torch.randn(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    a1, _ = gae(r, v, m, gamma=0.99, lam=0.9)
    pad = torch.zeros(2, 3)
    a2, _ = gae(torch.cat([r, pad + 5], 1), torch.cat([v, pad - 5], 1), torch.cat([m, pad.long()], 1),
                gamma=0.99, lam=0.9)
    assert torch.allclose(a1, a2[:, :4])


def test_masked_whiten_and_mean():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    w = masked_whiten(x, mask)
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)  # unbiased std of 1,2,3 is 1
    assert w[0, 3].item() == 0.0
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # empty mask: 0, not NaN


def test_registry_lists_valid_names():
    assert ADVANTAGE_ESTIMATORS.get("gae") is gae
    with pytest.raises(KeyError, match="valid: gae"):
        ADVANTAGE_ESTIMATORS.get("nope")

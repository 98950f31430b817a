import pytest
import torch

from rolefleet.algos import ADVANTAGE_ESTIMATORS, discounted_returns
from rolefleet.algos.advantages import gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo
from rolefleet.algos.functional import masked_mean, masked_whiten
from tests.algos import refs
from tests.algos.conftest import pad, unpad


def gae_reference(rewards, values, gamma, lam):
    """Independent float64 loop over one unpadded response."""
    values = list(values) + [0.0]
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * values[t + 1] - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values[:-1])]


def close(rows_a, rows_b):
    return all(a == pytest.approx(b, abs=1e-9) for a, b in zip(rows_a, rows_b))


# --- GAE --------------------------------------------------------------------------------------------

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
    adv, ret = gae(torch.where(mask, rewards, 1e6), torch.where(mask, values, -1e6), mask, gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        ref_adv, ref_ret = gae_reference(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(ref_adv)
        assert ret[i, :n].tolist() == pytest.approx(ref_ret)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


# --- outcome estimators -----------------------------------------------------------------------------

def test_grpo_hand_computed():
    # group 0 scores 1, 0 (mean 0.5, std 0.7071); group 1 scores 1, 1 (std 0 -> advantage 0)
    rewards, mask = pad([[0.0, 1.0], [0.0], [1.0], [0.5, 0.5]])
    adv, ret = grpo(rewards, mask, torch.tensor([0, 0, 1, 1]))
    a = 0.5 / (2 ** -0.5 + 1e-6)
    assert torch.allclose(adv, torch.tensor([[a, a], [-a, 0], [0, 0], [0, 0]], dtype=adv.dtype))
    assert torch.equal(adv, ret)
    dr, _ = grpo(rewards, mask, torch.tensor([0, 0, 1, 1]), norm_by_std=False)
    assert torch.allclose(dr, torch.tensor([[0.5, 0.5], [-0.5, 0], [0, 0], [0, 0]], dtype=dr.dtype))


def test_rloo_hand_computed():
    # scores 1, 0, 0.5 in one group: baselines (0+0.5)/2, (1+0.5)/2, (1+0)/2; a lone response gets 0
    rewards, mask = pad([[1.0], [0.0], [0.25, 0.25], [3.0]])
    adv, _ = rloo(rewards, mask, torch.tensor([4, 4, 4, 5]))
    assert torch.allclose(adv, torch.tensor([[0.75, 0], [-0.75, 0], [0.0, 0.0], [0, 0]], dtype=adv.dtype))


def test_reinforce_pp_hand_computed():
    rewards, mask = pad([[0.0, 1.0], [2.0]])
    returns = discounted_returns(rewards, mask, gamma=0.5)
    assert torch.allclose(returns, torch.tensor([[0.5, 1.0], [2.0, 0.0]], dtype=returns.dtype))
    adv, raw = reinforce_pp(rewards, mask, gamma=0.5)
    assert torch.equal(raw, returns)
    # returns 0.5, 1, 2: mean 7/6, unbiased variance 7/12
    assert adv[mask].tolist() == pytest.approx([(x - 7 / 6) / (7 / 12) ** 0.5 for x in (0.5, 1.0, 2.0)], abs=1e-6)
    assert adv[1, 1].item() == 0.0


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(ragged, norm_by_std):
    rows, groups = ragged
    rewards, mask = pad(rows)
    adv, _ = grpo(rewards, mask, groups, norm_by_std=norm_by_std)
    assert close(unpad(adv, mask), refs.grpo(rows, groups.tolist(), norm_by_std))


def test_rloo_matches_reference(ragged):
    rows, groups = ragged
    rewards, mask = pad(rows)
    assert close(unpad(rloo(rewards, mask, groups)[0], mask), refs.rloo(rows, groups.tolist()))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(ragged, gamma):
    rows, _ = ragged
    rewards, mask = pad(rows)
    adv, ret = reinforce_pp(rewards, mask, gamma=gamma)
    assert close(unpad(ret, mask), refs.discounted(rows, gamma))
    assert close(unpad(adv, mask), refs.whiten(refs.discounted(rows, gamma)))


def test_reinforce_pp_baseline_matches_reference(ragged):
    rows, groups = ragged
    rewards, mask = pad(rows)
    centred = refs.grpo(rows, groups.tolist(), norm_by_std=False)
    adv, raw = reinforce_pp_baseline(rewards, mask, groups)
    assert close(unpad(raw, mask), centred)
    assert close(unpad(adv, mask), refs.whiten(centred))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_ignore_padding_and_group_order(ragged, name):
    rows, groups = ragged
    fn = ADVANTAGE_ESTIMATORS.get(name)
    rewards, mask = pad(rows)
    wide, wide_mask = pad(rows, width=9, fill=123.0)  # extra padding holding garbage
    base, _ = fn(rewards, mask, groups)
    padded, _ = fn(torch.where(wide_mask, wide, 55.0), wide_mask, groups)
    assert torch.allclose(padded[:, : base.shape[1]], base) and torch.all(padded[~wide_mask] == 0)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])  # the batch order must not matter
    shuffled, _ = fn(rewards[perm], mask[perm], groups[perm])
    assert torch.allclose(shuffled, base[perm])


def test_discounted_returns_vectorised_equals_loop(ragged):
    rows, _ = ragged
    rewards, mask = pad(rows)
    assert close(unpad(discounted_returns(rewards, mask, 0.95), mask), refs.discounted(rows, 0.95))


# --- helpers and registry ---------------------------------------------------------------------------

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
    with pytest.raises(KeyError, match="valid: gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo"):
        ADVANTAGE_ESTIMATORS.get("nope")

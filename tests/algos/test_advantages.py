import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolefleet.algos import ADVANTAGE_ESTIMATORS, discounted_returns
from rolefleet.algos.advantages import distill, gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo
from rolefleet.algos.functional import masked_mean, masked_whiten
from tests.algos import refs
from tests.algos.conftest import pad, unpad
from tests.algos.edge import (
    FAST,
    FULL,
    GARBAGE,
    REWARD,
    Case,
    check_all_masked,
    check_case,
    covered,
    group_ids,
    masks,
    tensor,
)


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
    with pytest.raises(KeyError, match="valid: distill, gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo"):
        ADVANTAGE_ESTIMATORS.get("nope")


# --- on-policy distillation -------------------------------------------------------------------------

def test_distill_credits_each_token_with_the_teacher_s_logprob_minus_the_student_s():
    student = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -9.0, -9.0]])
    teacher = torch.tensor([[-1.5, -0.5, -1.0], [-0.3, 7.0, 7.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv, ret = distill(student, teacher, mask)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.5, 0.0], [-0.2, 0.0, 0.0]]))  # padding: 0
    assert torch.equal(adv, ret)


def test_distill_s_expected_advantage_is_minus_the_reverse_kl():
    """Over the student's own samples, E[teacher - student] = -KL(student || teacher): the advantage
    is the k1 estimate of the reverse KL per token, negated, and 0 exactly where they agree."""
    torch.manual_seed(0)
    student_logits, teacher_logits = torch.randn(16), torch.randn(16)
    student, teacher = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    tokens = torch.multinomial(student.exp(), 200_000, replacement=True)[None]
    adv, _ = distill(student[tokens], teacher[tokens], torch.ones_like(tokens, dtype=torch.bool))
    reverse_kl = (student.exp() * (student - teacher)).sum()
    assert adv.mean().item() == pytest.approx(-reverse_kl.item(), abs=0.02)
    assert not distill(student[tokens], student[tokens], torch.ones_like(tokens, dtype=torch.bool))[0].any()


# --- edge inputs (property-based) ---------------------------------------------------------------------

def _outcome_case(fn):
    def build(draw, mask):
        ids = group_ids(draw, mask.shape[0])
        kwargs = {"norm_by_std": draw(st.booleans())} if fn is grpo else {}
        return Case(lambda x: fn(x["token_rewards"], x["mask"], ids, **kwargs),
                    {"token_rewards": tensor(draw, REWARD, mask.shape)}, mask)
    return build


def _gae_case(draw, mask):
    gamma, lam = draw(st.floats(0.0, 1.0)), draw(st.floats(0.0, 1.0))
    return Case(lambda x: gae(x["token_rewards"], x["values"], x["mask"], gamma=gamma, lam=lam),
                {"token_rewards": tensor(draw, REWARD, mask.shape), "values": tensor(draw, REWARD, mask.shape)}, mask)


def _returns_case(fn):
    def build(draw, mask):
        gamma = draw(st.floats(0.0, 1.0))
        return Case(lambda x: fn(x["token_rewards"], x["mask"], gamma=gamma),
                    {"token_rewards": tensor(draw, REWARD, mask.shape)}, mask)
    return build


def _distill_case(draw, mask):
    return Case(lambda x: distill(x["logprobs"], x["teacher_logprobs"], x["mask"]),
                {"logprobs": tensor(draw, REWARD, mask.shape), "teacher_logprobs": tensor(draw, REWARD, mask.shape)},
                mask)


ESTIMATOR_CASES = {
    "distill": _distill_case,
    "gae": _gae_case,
    "grpo": _outcome_case(grpo),
    "rloo": _outcome_case(rloo),
    "reinforce_pp": _returns_case(reinforce_pp),
    "reinforce_pp_baseline": _outcome_case(reinforce_pp_baseline),
}
CASES = {**{(ADVANTAGE_ESTIMATORS.get(n), n): c for n, c in ESTIMATOR_CASES.items()},
         (discounted_returns, "discounted_returns"): _returns_case(discounted_returns)}
CASE_IDS = [name for _, name in CASES]


def test_every_estimator_has_edge_cases():
    covered(ESTIMATOR_CASES, ADVANTAGE_ESTIMATORS.names())


@pytest.mark.parametrize("fn, name", list(CASES), ids=CASE_IDS)
@FAST
@given(data=st.data(), mask=masks(), garbage=GARBAGE, dtype=FULL)
def test_estimators_on_edge_inputs(fn, name, data, mask, garbage, dtype):
    check_case(fn, CASES[fn, name](data.draw, mask), garbage, dtype)


@pytest.mark.parametrize("fn, name", list(CASES), ids=CASE_IDS)
@settings(FAST, max_examples=10)
@given(data=st.data(), mask=masks(all_masked=True))
def test_estimators_on_an_all_masked_batch(fn, name, data, mask):
    check_all_masked(CASES[fn, name](data.draw, mask))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_rows_without_tokens_take_no_part_in_group_statistics(name):
    # Response 2 of group 0 has no tokens: without it the group is {1, 0}, as if it were not there.
    rewards, mask = pad([[1.0], [0.0], [], [5.0], [3.0]], width=2)
    groups = torch.tensor([0, 0, 0, 1, 1])
    fn = ADVANTAGE_ESTIMATORS.get(name)
    adv, _ = fn(rewards, mask, groups)
    alone, _ = fn(rewards[[0, 1, 3, 4]], mask[[0, 1, 3, 4]], groups[[0, 1, 3, 4]])
    assert torch.allclose(adv[[0, 1, 3, 4]], alone) and torch.all(adv[2] == 0)


def test_estimators_reject_empty_and_mismatched_input_by_name():
    rewards, mask = torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_rewards is empty"):
        grpo(rewards, mask, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="token_rewards is empty"):
        gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="values has shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="group_ids must be"):
        rloo(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3, dtype=torch.long))


def test_bf16_rewards_accumulate_in_float32():
    # 300 tokens of 1.0 plus one of 0.5: bf16 cannot even hold 300.5 (its spacing there is 2).
    rewards = torch.ones(1, 301, dtype=torch.bfloat16)
    rewards[0, -1] = 0.5
    returns = discounted_returns(rewards, torch.ones(1, 301), gamma=1.0)
    assert returns.dtype == torch.float32 and returns[0, 0].item() == 300.5

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolefleet.algos import KL_CONTROLLERS, KL_ESTIMATORS, TEACHER_KL
from rolefleet.algos.kl import K3_MAX
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


# --- edge inputs (property-based) ---------------------------------------------------------------------

def _estimator_case(name):
    def build(draw, mask):
        fn, lp = KL_ESTIMATORS.get(name), tensor(draw, LOGPROB, mask.shape)
        # Elementwise, no mask argument: only the unmasked positions are promised anything.
        return Case(lambda x: fn(x["logprobs"], x["ref_logprobs"]),
                    {"logprobs": lp, "ref_logprobs": lp - tensor(draw, LOG_RATIO, mask.shape)}, mask,
                    grad=("logprobs",), elementwise=True)
    return build


ESTIMATOR_CASES = {name: _estimator_case(name) for name in ("k1", "k2", "k3")}


def test_every_kl_estimator_and_controller_has_edge_cases():
    covered(ESTIMATOR_CASES, KL_ESTIMATORS.names())
    covered(CONTROLLER_BOUNDS, KL_CONTROLLERS.names())


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
@FAST
@given(data=st.data(), mask=masks(), garbage=GARBAGE, dtype=FULL)
def test_kl_estimators_on_edge_inputs(name, data, mask, garbage, dtype):
    check_case(KL_ESTIMATORS.get(name), ESTIMATOR_CASES[name](data.draw, mask), garbage, dtype)


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
@settings(FAST, max_examples=5)
@given(data=st.data(), mask=masks(all_masked=True))
def test_kl_estimators_on_an_all_masked_batch(name, data, mask):
    check_all_masked(ESTIMATOR_CASES[name](data.draw, mask))


def test_k3_is_bounded_with_no_gradient_beyond_the_bound():
    # logp - ref = -12: r^-1 = e^12, so k3 = e^12 - 1 - 12 = 1.6e5 unbounded; verl's low_var_kl caps at 10.
    # The other side grows only linearly (k3 ~ -log r - 1) but is capped the same way.
    logp = torch.tensor([-12.0, -1e4, 0.0, -2.0], dtype=torch.float64, requires_grad=True)
    k3 = KL_ESTIMATORS.get("k3")(logp, torch.tensor([0.0, 0.0, -1e4, 0.0], dtype=torch.float64))
    k3.sum().backward()
    assert k3.tolist() == pytest.approx([K3_MAX, K3_MAX, K3_MAX, math.exp(2.0) - 3.0])
    # Capped tokens push nothing (and -1e4 no longer reaches exp: e^1e4 = inf, inf x 0 = NaN in the
    # backward); inside the bounds dk3/dlogp = 1 - e^(ref - logp).
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 1.0 - math.exp(2.0)])


def test_kl_estimators_reject_empty_and_mismatched_input_by_name():
    with pytest.raises(ValueError, match="logprobs is empty"):
        KL_ESTIMATORS.get("k3")(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        KL_ESTIMATORS.get("k1")(torch.zeros(3), torch.zeros(4))


# --- controllers --------------------------------------------------------------------------------------

# The most the coefficient may move in one update, as multipliers (lowest, highest).
CONTROLLER_BOUNDS = {"fixed": (1.0, 1.0), "adaptive": (0.8, 1.2)}


@pytest.mark.parametrize("name", KL_CONTROLLERS.names())
@FAST
@given(coef=st.floats(0.0, 1e6), current_kl=st.floats(allow_nan=True, allow_infinity=True),
       target=st.floats(1e-6, 10.0), horizon=st.integers(1, 10_000), n_steps=st.integers(0, 10**7))
def test_controllers_keep_the_coefficient_finite_non_negative_and_bounded(name, coef, current_kl, target,
                                                                           horizon, n_steps):
    new = KL_CONTROLLERS.get(name)(coef, current_kl, target, horizon, n_steps)
    low, high = CONTROLLER_BOUNDS[name]
    assert math.isfinite(new) and new >= 0
    assert coef * low * (1 - 1e-12) <= new <= coef * high * (1 + 1e-12)
    if not math.isfinite(current_kl):
        assert new == coef


def test_adaptive_controller_stays_positive_when_n_steps_far_exceeds_the_horizon():
    # Ziegler's 1 + error * n / horizon = 1 - 0.2 * 1000 / 10 = -19: the coefficient went negative.
    assert KL_CONTROLLERS.get("adaptive")(0.1, current_kl=0.0, target=0.1, horizon=10, n_steps=1000) == pytest.approx(0.08)
    assert KL_CONTROLLERS.get("adaptive")(0.1, current_kl=1.0, target=0.1, horizon=10, n_steps=1000) == pytest.approx(0.12)


@pytest.mark.parametrize("current_kl", [math.nan, math.inf, -math.inf])
def test_adaptive_controller_ignores_a_non_finite_kl(current_kl):
    assert KL_CONTROLLERS.get("adaptive")(0.1, current_kl, target=0.1, horizon=10, n_steps=5) == 0.1


@pytest.mark.parametrize("name", KL_CONTROLLERS.names())
@pytest.mark.parametrize("kwargs, named", [({"coef": -0.1}, "coef"), ({"target": 0.0}, "target"),
                                           ({"horizon": 0}, "horizon"), ({"n_steps": -1}, "n_steps")])
def test_controllers_reject_meaningless_settings_by_name(name, kwargs, named):
    args = {"coef": 0.1, "current_kl": 0.1, "target": 0.1, "horizon": 10, "n_steps": 1, **kwargs}
    with pytest.raises(ValueError, match=f"^{named} must be"):
        KL_CONTROLLERS.get(name)(**args)


# --- the teacher's KL over its top k ------------------------------------------------------------------

def _top(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logp.gather(-1, ids)


def test_teacher_kl_over_the_whole_vocabulary_is_the_exact_kl():
    torch.manual_seed(0)
    teacher, student = torch.log_softmax(torch.randn(3, 5, 7), -1), torch.log_softmax(torch.randn(3, 5, 7), -1)
    ids = teacher.argsort(-1, descending=True)  # k = V: nothing in the tail
    exact_forward = (teacher.exp() * (teacher - student)).sum(-1)
    exact_reverse = (student.exp() * (student - teacher)).sum(-1)
    torch.testing.assert_close(TEACHER_KL.get("forward")(_top(teacher, ids), _top(student, ids)), exact_forward,
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(TEACHER_KL.get("reverse")(_top(teacher, ids), _top(student, ids)), exact_reverse,
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["forward", "reverse"])
def test_teacher_kl_over_a_top_k_is_the_kl_of_the_top_k_and_the_rest_as_one(name):
    torch.manual_seed(1)
    teacher, student = torch.log_softmax(torch.randn(4, 9), -1), torch.log_softmax(torch.randn(4, 9), -1)
    ids = teacher.topk(3, -1).indices
    got = TEACHER_KL.get(name)(_top(teacher, ids), _top(student, ids))

    def coarse(logp):  # the 3 tokens, then everything else as one outcome
        top = logp.gather(-1, ids).exp()
        return torch.cat([top, 1 - top.sum(-1, keepdim=True)], -1)

    p, q = coarse(teacher), coarse(student)
    if name == "reverse":
        p, q = q, p
    torch.testing.assert_close(got, (p * (p / q).log()).sum(-1), atol=1e-5, rtol=1e-4)
    assert torch.all(got >= 0)
    # 0 where the student gives the k tokens the teacher's probabilities, whatever it does in the tail.
    same = teacher.clone()
    same[:, :] = torch.log_softmax(torch.randn(4, 9), -1)
    same.scatter_(-1, ids, _top(teacher, ids))
    assert torch.allclose(TEACHER_KL.get(name)(_top(teacher, ids), _top(same, ids)), torch.zeros(4), atol=1e-6)


@pytest.mark.parametrize("name", ["forward", "reverse"])
def test_teacher_kl_gradient_moves_the_student_toward_the_teacher(name):
    torch.manual_seed(2)
    teacher = torch.log_softmax(3 * torch.randn(2, 6, 11), -1)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    ids = teacher.topk(4, -1).indices
    opt = torch.optim.Adam([logits], lr=0.1)
    first = None
    for _ in range(200):
        kl = TEACHER_KL.get(name)(_top(teacher, ids), _top(torch.log_softmax(logits, -1), ids)).sum()
        first = kl.item() if first is None else first
        opt.zero_grad()
        kl.backward()
        opt.step()
    assert kl.item() < 0.05 * first
    torch.testing.assert_close(_top(torch.log_softmax(logits, -1), ids).exp(), _top(teacher, ids).exp(), atol=0.02,
                               rtol=0)


@pytest.mark.parametrize("name", ["forward", "reverse"])
def test_teacher_kl_is_finite_with_its_gradient_at_extremes(name):
    # The student's top k holding all its mass (an empty tail), a teacher token the student finds
    # near impossible, half precision: finite values and gradients, computed in float32.
    teacher = torch.tensor([[[-0.01, -5.0, -1e4]], [[0.0, -1e4, -1e4]]])
    student = torch.tensor([[[-1e4, -0.0, -1e4]], [[-1e-9, -30.0, -40.0]]], requires_grad=True)
    kl = TEACHER_KL.get(name)(teacher, student)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(student.grad).all() and torch.all(kl >= -1e-6)
    half = TEACHER_KL.get(name)(teacher.bfloat16(), student.detach().bfloat16())
    assert half.dtype == torch.float32
    with pytest.raises(ValueError, match="student_logprobs has shape"):
        TEACHER_KL.get(name)(teacher, student[..., :2])

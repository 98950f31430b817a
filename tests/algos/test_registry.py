import pytest
import torch

from rolefleet.algos import ADVANTAGE_ESTIMATORS
from rolefleet.algos.registry import Registry


def make_registry():
    reg = Registry("thing")

    @reg.register("needs_a")
    def needs_a(a, b=2):
        return a + b

    @reg.register("needs_c")
    def needs_c(c):
        return c

    return reg


def test_call_passes_only_the_declared_inputs_and_keeps_defaults():
    reg = make_registry()
    assert reg.call("needs_a", a=1, c=100, unused="x") == 3
    assert reg.call("needs_a", a=1, b=5) == 6


def test_call_names_a_required_input_that_is_not_available():
    with pytest.raises(TypeError, match="thing 'needs_c' needs 'c', which is not available \\(available: a, b\\)"):
        make_registry().call("needs_c", a=1, b=2)


def test_call_of_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(KeyError, match="valid: needs_a, needs_c"):
        make_registry().call("nope", a=1)


def test_registering_a_name_twice_is_an_error():
    reg = make_registry()
    with pytest.raises(ValueError, match="already registered"):
        reg.register("needs_a")(lambda: None)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_runs_on_what_the_coordinator_offers(name):
    # The inputs services/coordinator/targets.py offers: an estimator needing anything else fails here.
    rewards = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    offered = dict(token_rewards=rewards, values=torch.zeros(2, 2), mask=mask, group_ids=torch.tensor([0, 0]),
                   gamma=1.0, lam=0.95, norm_by_std=True, logprobs=-torch.ones(2, 2),
                   teacher_logprobs=-2 * torch.ones(2, 2))
    advantages, returns = ADVANTAGE_ESTIMATORS.call(name, **offered)
    assert advantages.shape == returns.shape == (2, 2) and torch.all(advantages[~mask] == 0)

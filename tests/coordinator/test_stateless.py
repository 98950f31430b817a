"""A role without training state (the reward) that goes away: its calls are repeated once it is
back, within a bound; past the bound the run fails naming the key (`calls.Retries`, the one
application-level policy)."""

import asyncio

import pytest

from rolefleet.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.calls import Retries
from rolefleet.coordinator.loop import Roles
from rolefleet.coordinator.saved_state import CoordinatorState


class Flaky:
    """A reward client that is away for its first `down` calls."""

    def __init__(self, down: int, error: Exception | None = None):
        self.down, self.error, self.calls = down, error or Unavailable("connection refused"), []

    async def score(self, items):
        self.calls.append(list(items))
        if len(self.calls) <= self.down:
            raise self.error
        return f"scores of {items}"

    def active_labels(self):
        return ["a:1"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0  # a second passes between looks
        return self.now


def wrap(inner, bound_s=10.0):
    retries = Retries(retries=2, state=CoordinatorState(step=0, kl_coef=0.0), stateless_wait_s=bound_s, clock=Clock(),
                      poll_s=0)
    reward = retries.wrap(Roles(actor=None, reward=inner, critic=None)).reward
    reward.retries = retries
    return reward


def test_a_call_to_a_role_that_went_away_is_repeated_once_it_answers():
    inner = Flaky(down=3)
    client = wrap(inner)
    assert asyncio.run(client.score(["a", "b"])) == "scores of ['a', 'b']"
    assert inner.calls == [["a", "b"]] * 4 and client.retries.repeated["reward"] == 3
    # Not bounded by pipeline.retries (2): a stateless role is waited for by time alone; counted.
    assert client.retries.state.counts.retries == 3
    assert client.active_labels() == ["a:1"]  # the rest of the client is the inner one's


def test_past_the_bound_the_run_fails_naming_the_role_and_key():
    client = wrap(Flaky(down=100), bound_s=5)
    with pytest.raises(FailedPrecondition, match=r"reward role has not answered score for 5 s \(reward.restart_wait_s\)"):
        asyncio.run(client.score(["a"]))
    assert not isinstance(FailedPrecondition("x"), Unavailable)  # so the run's recovery does not take it


def test_other_errors_are_not_repeated():
    inner = Flaky(down=1, error=InvalidArgument("items[0]", "too big"))
    with pytest.raises(InvalidArgument):
        asyncio.run(wrap(inner).score(["a"]))
    assert len(inner.calls) == 1


def test_the_busy_clock_still_times_the_repeated_calls():
    clock = BusyClock()
    roles = clock.track(Roles(actor=None, reward=wrap(Flaky(down=1)), critic=None))
    asyncio.run(roles.reward.score(["a"]))
    assert clock.fractions()["busy/reward"] > 0

"""Role calls repeated on a transient failure (`pipeline.retries`, both modes): counted in the
coordinator's state, never sent to a trainer that came back without the run's updates; and that
state as checkpoints hold it, from this version and from the earlier sync and async ones."""

import asyncio
import json
from pathlib import Path

import pytest

from rolefleet.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolefleet.common.role_types import RoleStatus
from rolefleet.coordinator import calls
from rolefleet.coordinator.calls import Retries, Roles
from rolefleet.coordinator.saved_state import CoordinatorState, PipelineCounts, from_document, read_state, write_state


class Flaky:
    """A role client whose first `down` calls fail with `error`; its status reports `last_step`
    (None: the status call fails too)."""

    def __init__(self, down: int, last_step: int | None = 0, error: Exception | None = None):
        self.down, self.last_step, self.error, self.calls = down, last_step, error or Unavailable("refused"), 0

    async def update(self, step):
        self.calls += 1
        if self.calls <= self.down:
            raise self.error
        return f"update {step}"

    async def status(self, include_digest=False):
        if self.last_step is None:
            raise Unavailable("status refused")
        return RoleStatus(role="x", model_version=self.last_step, last_step=self.last_step)

    async def generate_stream(self, prompts):
        yield prompts


def wrapped(state, actor=None, reward=None, critic=None, retries=2, warmup=0):
    return Retries(retries, state, warmup, stateless_wait_s=10.0, poll_s=0).wrap(Roles(actor or Flaky(0), reward or Flaky(0), critic))


def test_a_transient_failure_is_repeated_and_counted():
    state = CoordinatorState(step=3, kl_coef=0.0)
    roles = wrapped(state, actor=Flaky(2, last_step=3), reward=Flaky(1))
    assert asyncio.run(roles.actor.update(4)) == "update 4" and asyncio.run(roles.reward.update(1)) == "update 1"
    # The reward's repeat is bounded by its own wait (reward.restart_wait_s, test_stateless.py); counted too.
    assert state.counts.retries == 3


def test_past_the_retries_the_call_fails_with_its_error():
    state = CoordinatorState(step=0, kl_coef=0.0)
    critic = Flaky(5)
    with pytest.raises(Unavailable, match="refused"):
        asyncio.run(wrapped(state, critic=critic, retries=2).critic.update(1))
    assert critic.calls == 3 and state.counts.retries == 2


@pytest.mark.parametrize("last_step", [0, None])
def test_a_trainer_that_lost_the_runs_updates_or_does_not_answer_is_not_asked_again(last_step):
    """A restarted process (its last step behind the run's) would take the call without the run's
    updates: the call fails, and the run recovers from its checkpoint instead."""
    state = CoordinatorState(step=3, kl_coef=0.0)
    critic = Flaky(1, last_step=last_step)
    with pytest.raises(Unavailable, match="refused"):
        asyncio.run(wrapped(state, critic=critic).critic.update(4))
    assert critic.calls == 1 and state.counts.retries == 0


def test_during_the_critic_warmup_the_actor_is_expected_behind_by_it():
    state = CoordinatorState(step=3, kl_coef=0.0)
    actor = Flaky(1, last_step=1)  # 3 steps, 2 of them the critic's warm-up
    assert asyncio.run(wrapped(state, actor=actor, warmup=2).actor.update(2)) == "update 2"


def test_other_errors_and_streams_are_not_repeated():
    state = CoordinatorState(step=0, kl_coef=0.0)
    reward, actor = Flaky(1, error=InvalidArgument("items", "bad")), Flaky(0)
    roles = wrapped(state, actor=actor, reward=reward)
    with pytest.raises(InvalidArgument):
        asyncio.run(roles.reward.update(1))
    assert reward.calls == 1 and roles.actor.generate_stream.__func__ is Flaky.generate_stream


def test_the_coordinator_state_round_trips_and_reads_earlier_checkpoints(tmp_path):
    state = CoordinatorState(step=4, kl_coef=0.05, data={"position": 32}, counts=PipelineCounts(retries=2),
                             record={"step": 4, "reward/mean": 0.5, "reward/versions": {"r": "abc"}})
    write_state(tmp_path, state, Path.write_bytes)
    assert read_state(tmp_path) == state and json.loads((tmp_path / "coordinator.json").read_text())["version"] == 4
    three = {"version": 3, "step": 4, "kl_coef": 0.05}  # before the step's record travelled with it
    assert from_document(three) == CoordinatorState(4, 0.05) and from_document(three).record is None
    sync = {"version": 1, "step": 3, "kl_coef": 0.04, "data": {"position": 24}}  # the sync loop's
    assert from_document(sync) == CoordinatorState(3, 0.04, {"position": 24})
    counts = {"stale_samples": 1, "dropped_batches": 2, "regenerated_batches": 0, "retries": 3}
    asynchronous = {**sync, "counts": counts}  # the async pipeline's
    assert from_document(asynchronous).counts == PipelineCounts(**counts)
    assert from_document(asynchronous).batches_used == 5  # its steps' and the dropped batches
    assert from_document({"version": 1, "step": 0, "kl_coef": 0}) == CoordinatorState(0, 0.0)  # step 0
    for bad, key in (({"kl_coef": 0.0}, "step"), ({"step": -1, "kl_coef": 0.0}, "step"),
                     ({"step": 1, "kl_coef": "high"}, "kl_coef"), ({"step": 1, "kl_coef": float("nan")}, "kl_coef"),
                     ({"step": 1, "kl_coef": 0.0, "data": [1]}, "data"),
                     ({"step": 1, "kl_coef": 0.0, "counts": {"lost": 1}}, "counts"),
                     ({"step": 1, "kl_coef": 0.0, "carried": [{"batch": 0}]}, "carried")):
        with pytest.raises(ValueError, match=f"^{key}"):
            from_document(bad)


@pytest.mark.parametrize("version", [None, 0, 5, "2"])
def test_a_state_of_another_version_is_refused_naming_the_file_and_the_version(tmp_path, version):
    (tmp_path / "coordinator.json").write_text(json.dumps({"version": version, "step": 3, "kl_coef": 0.0}))
    with pytest.raises(ValueError, match=rf"coordinator.json is of state version {version!r}; this coordinator reads "):
        read_state(tmp_path)


class Restarting:
    """A trainer holding step 3 as process "first"; `restart()` makes it come back as process
    "second" with its initial state, after `away` status calls that find nothing (a death under a
    call: `dies` makes its next call fail). `sent`: (process, last step) of each call that reached one."""

    def __init__(self, away: int = 0, dies: bool = False):
        self.instance, self.last_step, self.away, self.dies, self.sent = "first", 3, away, dies, []

    def restart(self) -> None:
        self.instance, self.last_step = "second", 0

    async def update(self, step):
        if self.last_step is None:
            raise Unavailable("refused")
        self.sent.append((self.instance, self.last_step))
        if self.dies:
            self.dies, self.last_step = False, None
            raise Unavailable("refused: the process died under the call")
        return f"update {step}"

    async def status(self, include_digest=False):
        if self.last_step is None:
            self.away -= 1
            if self.away >= 0:
                raise Unavailable("status refused")
            self.restart()
        return RoleStatus(role="critic", model_version=self.last_step, last_step=self.last_step,
                          instance_id=self.instance)


def loading_alone(state, critic: Restarting, snapshot_there: bool):
    """Roles whose restarted trainers are loaded from the run's snapshot (when `snapshot_there`); the
    loads, as (role, step)."""
    loaded = []

    async def restore(role, step, since):
        loaded.append((role, step))
        if snapshot_there:
            critic.last_step = step
        return snapshot_there

    return Retries(2, state, restore=restore, wait_s=30).wrap(Roles(Flaky(0), Flaky(0), critic)), loaded


@pytest.mark.parametrize("snapshot_there", [True, False])
def test_a_restarted_trainer_is_loaded_alone_and_its_other_calls_wait_for_it(snapshot_there):
    """The call that met the loss waits for the process to come back, has it loaded from the run's
    snapshot of the run's step and is repeated; a call made meanwhile (async mode's concurrent ones)
    is held, never reaching the new process before it is loaded. Without that snapshot both fail,
    and the run recovers from its newest one."""
    state = CoordinatorState(step=3, kl_coef=0.0)
    critic = Restarting(away=3, dies=True)
    roles, loaded = loading_alone(state, critic, snapshot_there)

    async def both():
        first = asyncio.create_task(roles.critic.update(4))
        await asyncio.sleep(0.05)  # the first call failed: the trainer is being waited for
        return await asyncio.gather(first, roles.critic.update(5), return_exceptions=True)

    results = asyncio.run(both())
    assert loaded == [("critic", 3)]
    if snapshot_there:
        assert results == ["update 4", "update 5"] and state.counts.retries == 1
        assert critic.sent == [("first", 3), ("second", 3), ("second", 3)]  # only to the loaded process
    else:
        assert all(isinstance(r, Unavailable) for r in results)
        assert critic.sent == [("first", 3)]  # nothing reached the process that was not loaded


def test_a_trainer_restarted_between_calls_is_caught_before_a_call_reaches_it(monkeypatch):
    """No call saw it away (it died and came back between two): the next call finds another process
    answering and has it loaded first."""
    monkeypatch.setattr(calls, "SAME_PROCESS_EVERY_S", 0.0)
    state = CoordinatorState(step=3, kl_coef=0.0)
    critic = Restarting()
    roles, loaded = loading_alone(state, critic, snapshot_there=True)
    assert asyncio.run(roles.critic.update(4)) == "update 4"
    critic.restart()
    assert asyncio.run(roles.critic.update(5)) == "update 5"
    assert loaded == [("critic", 3)] and critic.sent == [("first", 3), ("second", 3)]


def test_a_stop_ends_the_wait_for_a_role_that_does_not_come_back():
    """A trainer (or the reward) lost for good is waited for `wait_s` (minutes, train.connect_timeout_s);
    a run asked to stop meanwhile gives up at once, the call failing as at the wait's end, so SIGTERM
    does not hold the coordinator until its supervisor kills it."""
    state = CoordinatorState(step=3, kl_coef=0.0)
    stop = {"asked": False}

    async def restore(role, step, since):
        raise AssertionError("nothing to load: the trainer never answered")

    critic, reward = Flaky(10**6, last_step=None), Flaky(10**6)
    roles = Retries(2, state, restore=restore, wait_s=300.0, stateless_wait_s=300.0, poll_s=0.01,
                    stopping=lambda: stop["asked"]).wrap(Roles(Flaky(0), reward, critic))

    async def asked_to_stop(call):
        task = asyncio.create_task(call)
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting for the role to come back
        stop["asked"] = True
        return await asyncio.wait_for(task, timeout=2.0)  # ends within a poll, not after 300 s

    with pytest.raises(Unavailable, match="refused"):
        asyncio.run(asked_to_stop(roles.critic.update(4)))
    stop["asked"] = False
    with pytest.raises(FailedPrecondition, match="asked to stop while the reward role did not answer update"):
        asyncio.run(asked_to_stop(roles.reward.update(4)))

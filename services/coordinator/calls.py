"""The run's role clients, and the repeat of a role call that failed transiently (`pipeline.retries`),
the same in both modes.

Every call is safe to repeat: generation is seeded, scoring pure, and the trainers' updates are
idempotent per step. A repeat is only worth sending to a process that holds the run's updates,
though: a trainer that came back as a new process (its weights and optimizer at their start) would
answer it, or take an update it cannot follow, without them. So before it repeats a trainer's call
the coordinator asks the trainer for its last step. One that does not answer is waited for (its
restart, up to `train.connect_timeout_s`) while the other roles' work goes on (in async mode: the
actor generates within the bound, the reward scores); one that answers behind the run is loaded
alone from the run's snapshot (or checkpoint) of the run's step, and the call repeated: the step
goes on where it was, nothing is trained twice and nothing the others did is lost. Where there is
no such snapshot (the one of the run's step was being written when the trainer died), the call
fails with its error and the run recovers from its newest one (`loop.train`).

A role that holds no training state (the reward and its replicas) has nothing to lose: a restarted
reward server scores the same items the same way, so its call is sent again once it answers, for
up to `reward.restart_wait_s` from the first failure, and the trainers never rewind. Past that the
run fails naming the key.

This is the one application-level policy (docs/operations.md, "Retries"): below it, gRPC retries a
call answered UNAVAILABLE on its channel (`rpc/channels.py`, the service config) and the reward's
replica set sends a failed shard to another replica; nothing else repeats a call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, TypeVar

from rolefleet.actor.client import ActorClient
from rolefleet.common.errors import FailedPrecondition, Unavailable
from rolefleet.common.role_types import RoleStatus
from rolefleet.coordinator.saved_state import CoordinatorState
from rolefleet.critic.client import CriticClient
from rolefleet.reward.client import RewardClient
from rolefleet.teacher.client import TeacherClient

log = logging.getLogger(__name__)
T = TypeVar("T")
TRAINERS = ("actor", "critic")
# The roles without training state, and the key bounding how long a call to one is repeated.
STATELESS_KEY = {"reward": "reward.restart_wait_s", "teacher": "reward.restart_wait_s"}
SAME_PROCESS_EVERY_S = 1.0  # below the time any trainer takes to restart (`Retries._same_process`)
POLL_S = 0.5  # between looks at a role that is away: a restart under `rolefleet up` takes seconds


async def answering(client: Any, deadline: float, poll_s: float = POLL_S,
                    clock: Callable[[], float] = time.monotonic,
                    give_up: Callable[[], bool] = lambda: False) -> RoleStatus | None:
    """The role's status once it answers, looked for every `poll_s` until `deadline` (`clock`'s
    time); None if it has not answered by then, or as soon as `give_up()` (the run was asked to
    stop: a role lost for good must not hold a stopping run for the whole wait)."""
    while True:
        try:
            return await client.status()
        except Unavailable:
            if clock() > deadline or give_up():
                return None
            await asyncio.sleep(poll_s)


@dataclass
class Roles:
    actor: ActorClient
    reward: RewardClient
    critic: Optional[CriticClient]
    teacher: Optional[TeacherClient] = None  # on-policy distillation (cfg.uses_teacher)


class Retries:
    """`retries` repeats of a call answered UNAVAILABLE (or past its deadline), with backoff,
    counted in `state.counts.retries`. `warmup`: `train.critic_warmup_steps`, the steps the actor
    applies none of (its own step ids lag the run's by it)."""

    def __init__(self, retries: int, state: CoordinatorState, warmup: int = 0,
                 restore: Callable[[str, int, float], Awaitable[bool]] | None = None, wait_s: float = 0.0,
                 stateless_wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S,
                 stopping: Callable[[], bool] = lambda: False):
        """`restore(role, step, since)`: load trainer `role` alone from the run's snapshot or
        checkpoint of run step `step` (False: there is none), the loss having begun at `since`
        (time.monotonic); `wait_s`: how long a trainer that does not answer is waited for;
        `stateless_wait_s`: how long a call to a role without training state is repeated;
        `stopping()`: the run was asked to stop, which ends either wait at once (the call fails
        as at the wait's end: a stop is not held for minutes by a role that may never return)."""
        self.retries, self.state, self.warmup = retries, state, warmup
        self.restore, self.wait_s, self.stateless_wait_s = restore, wait_s, stateless_wait_s
        self.clock, self.poll_s, self.stopping = clock, poll_s, stopping
        self.repeated: dict[str, int] = {}  # calls to a stateless role sent again: what its loss cost
        self._clients: dict[str, Any] = {}  # the clients `wrap` was given, asked for status unrepeated
        # Per trainer, set while its calls may go out: cleared from its first failure until it is
        # back, so that no other call (async mode's concurrent ones) reaches a restarted process
        # before it is loaded and takes its initial weights for the run's.
        self._open: dict[str, asyncio.Event] = {}
        self._gone: dict[str, Unavailable] = {}  # a trainer that did not come back: what its held calls raise
        # The process each trainer's calls go to (RoleStatus.instance_id) and when that was last
        # checked: one restarted between two calls, which no call saw away, is caught before a call
        # reaches it (its answers would be its initial weights').
        self._instance: dict[str, str] = {}
        self._checked: dict[str, float] = {}

    def wrap(self, roles: Roles) -> Roles:
        """The same Roles, each client's coroutine methods repeated on a transient failure (a
        stream is not: its reader decides what a repeat means, through `again`)."""
        self._clients = {f.name: getattr(roles, f.name) for f in fields(roles) if getattr(roles, f.name) is not None}
        return replace(roles, **{name: _Repeated(client, name, self) for name, client in self._clients.items()})

    async def call(self, role: str, method: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        attempt, since = 0, None
        while True:
            if role in self._open:
                await self._open[role].wait()
                if role in self._gone:  # the run recovers: no call goes to a process not loaded
                    raise self._gone[role]
            try:
                if role in TRAINERS and self.restore is not None:
                    await self._same_process(role)
                return await method(*args, **kwargs)
            except Unavailable as exc:
                if role in STATELESS_KEY:
                    since = self.clock() if since is None else since
                    await self._stateless_back(role, getattr(method, "__name__", "call"), exc, since)
                else:
                    await self.again(role, attempt, exc)
                attempt += 1

    async def _stateless_back(self, role: str, name: str, exc: Unavailable, since: float) -> None:
        """Before the call of `name` to stateless `role` is sent again: a pause, unless
        `stateless_wait_s` have passed since its first failure (`since`), or the run is stopping,
        which fails the run."""
        key = STATELESS_KEY[role]
        if self.stopping():
            raise FailedPrecondition(f"the run was asked to stop while the {role} role did not answer {name}: {exc}") \
                from exc
        if self.clock() - since >= self.stateless_wait_s:
            raise FailedPrecondition(f"the {role} role has not answered {name} for {self.stateless_wait_s:g} s "
                                     f"({key}): {exc}") from exc
        if not self.repeated.get(role):
            log.warning("%s.%s failed (%s); the %s holds no training state: sending it again once it answers, for up "
                        "to %g s (%s)", role, name, exc, role, self.stateless_wait_s, key)
        self.repeated[role] = self.repeated.get(role, 0) + 1
        self.state.counts.retries += 1
        await asyncio.sleep(self.poll_s)

    async def _same_process(self, role: str) -> None:
        """Unavailable when trainer `role` answers as another process than its calls went to. Asked
        at most every `SAME_PROCESS_EVERY_S`: a restart takes longer (a process starts and loads its
        model), so the first call after one always asks."""
        now = time.monotonic()
        if now - self._checked.get(role, -math.inf) < SAME_PROCESS_EVERY_S:
            return
        instance = (await self._clients[role].status()).instance_id
        known = self._instance.setdefault(role, instance)
        if instance != known:
            raise Unavailable(f"the {role} answers as a new process ({instance}, its calls went to {known})")
        self._checked[role] = now

    async def again(self, role: str, attempt: int, exc: Unavailable) -> None:
        """After failed attempt `attempt` (0-based) of a call to `role`: return once it may be sent
        again, or raise `exc` when it may not."""
        if attempt >= self.retries:
            raise exc
        log.warning("transient failure, retrying (%d of %d): %s", attempt + 1, self.retries, exc)
        since = time.monotonic()
        gate = self._open.setdefault(role, asyncio.Event()) if role in TRAINERS else None
        if gate is not None:
            gate.clear()
        await asyncio.sleep(min(2.0 ** attempt * 0.1, 5.0))
        if gate is not None:
            try:
                await self._trainer_back(role, exc, since)
            except Unavailable:
                self._gone[role] = exc
                raise
            finally:
                gate.set()  # back (the held calls go out), or not (they fail as this one)
        self.state.counts.retries += 1

    def _expected(self, role: str) -> int:
        """The trainer's own step id of the run's last counted update."""
        return max(0, self.state.step - self.warmup) if role == "actor" else self.state.step

    async def _status(self, role: str) -> RoleStatus | None:
        """The trainer's status; None while it does not answer."""
        try:
            return await self._clients[role].status()
        except Unavailable:
            return None

    async def _trainer_back(self, role: str, exc: Unavailable, since: float) -> None:
        """Once trainer `role` holds every update the run has counted: it is the process the call
        failed on, or one that lost nothing, or a restarted one loaded alone (`restore`); its calls
        go to that process from now on. Raises `exc` when it does not come back in time or cannot
        be loaded so."""
        status = await self._status(role)
        if status is None or status.last_step < self._expected(role):
            if self.restore is None:
                log.warning("the %s %s (the run has applied its steps up to %d): not repeating the call", role,
                            "does not answer" if status is None else f"is at step {status.last_step}",
                            self._expected(role))
                raise exc
            if status is None:  # restarting: only this call waits for it
                status = await answering(self._clients[role], since + self.wait_s, self.poll_s,
                                         give_up=self.stopping)
                if status is None:
                    raise exc
            if status.last_step < self._expected(role) and not await self.restore(role, self.state.step, since):
                raise exc
        self._instance[role], self._checked[role] = status.instance_id, time.monotonic()


class _Repeated:
    def __init__(self, inner: Any, role: str, retries: Retries):
        self._inner, self._role, self._retries = inner, role, retries

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if inspect.isasyncgenfunction(attr) or not asyncio.iscoroutinefunction(attr):
            return attr

        async def repeated(*args, **kwargs):  # a coroutine function, as the busy clock times them
            return await self._retries.call(self._role, attr, *args, **kwargs)

        return repeated

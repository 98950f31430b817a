"""The run's role clients, and the repeat of a role call that failed transiently (`pipeline.retries`),
the same in both modes.

Every call is safe to repeat: generation is seeded, scoring pure, and the trainers' updates are
idempotent per step. A repeat is only worth sending to the process that failed, though: a trainer
that came back as a new process (its weights and optimizer at their start) would answer it, or
take an update it cannot follow, without the run's updates. So before it repeats a trainer's call
the coordinator asks the trainer for its last step; one behind the run (or that does not answer)
makes the call fail with its error, and the run recovers from its newest checkpoint (`loop.train`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, TypeVar

from rolefleet.actor.client import ActorClient
from rolefleet.common.errors import Unavailable
from rolefleet.coordinator.checkpoints import CoordinatorState
from rolefleet.critic.client import CriticClient
from rolefleet.reward.client import RewardClient

log = logging.getLogger(__name__)
T = TypeVar("T")
TRAINERS = ("actor", "critic")


@dataclass
class Roles:
    actor: ActorClient
    reward: RewardClient
    critic: Optional[CriticClient]


class Retries:
    """`retries` repeats of a call answered UNAVAILABLE (or past its deadline), with backoff,
    counted in `state.counts.retries`. `warmup`: `train.critic_warmup_steps`, the steps the actor
    applies none of (its own step ids lag the run's by it)."""

    def __init__(self, retries: int, state: CoordinatorState, warmup: int = 0):
        self.retries, self.state, self.warmup = retries, state, warmup
        self._clients: dict[str, Any] = {}  # the clients `wrap` was given, asked for status unrepeated

    def wrap(self, roles: Roles) -> Roles:
        """The same Roles, each client's coroutine methods repeated on a transient failure (a
        stream is not: its reader decides what a repeat means, through `again`)."""
        self._clients = {f.name: getattr(roles, f.name) for f in fields(roles) if getattr(roles, f.name) is not None}
        return replace(roles, **{name: _Repeated(client, name, self) for name, client in self._clients.items()})

    async def call(self, role: str, method: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        attempt = 0
        while True:
            try:
                return await method(*args, **kwargs)
            except Unavailable as exc:
                await self.again(role, attempt, exc)
                attempt += 1

    async def again(self, role: str, attempt: int, exc: Unavailable) -> None:
        """After failed attempt `attempt` (0-based) of a call to `role`: return once it may be sent
        again, or raise `exc` when it may not."""
        if attempt >= self.retries:
            raise exc
        log.warning("transient failure, retrying (%d of %d): %s", attempt + 1, self.retries, exc)
        await asyncio.sleep(min(2.0 ** attempt * 0.1, 5.0))
        if role in TRAINERS and not await self._holds_the_run(role):
            raise exc
        self.state.counts.retries += 1

    async def _holds_the_run(self, role: str) -> bool:
        """Whether trainer `role` still holds every update the run has counted (it is the process
        the call failed on, or one that lost nothing)."""
        expected = max(0, self.state.step - self.warmup) if role == "actor" else self.state.step
        try:
            last = (await self._clients[role].status()).last_step
        except Unavailable:
            last = None  # still away: the run's recovery waits for it
        if last is not None and last >= expected:
            return True
        log.warning("the %s %s (the run has applied its steps up to %d): not repeating the call", role,
                    "does not answer" if last is None else f"is at step {last}", expected)
        return False


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

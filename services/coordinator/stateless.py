"""Calls to a role that holds no training state (the reward and its replicas), repeated across the
role's death and restart instead of rolling the trainers back.

Such a role has nothing to lose: a restarted reward server scores the same items the same way, so
the coordinator only has to wait until it (or another replica) answers again and send the same call
once more. The trainers never rewind and the journal records each step once. A trainer's loss is
another matter (its weights and optimizer are gone): that goes to the run's recovery from a
checkpoint (`loop.train`). Past the bound the run fails, naming the role and the key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rolefleet.common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.5  # between tries while the role is away: a restart under `rolefleet up` takes seconds


class WaitsForRestart:
    """A role client whose `methods` are repeated while they fail with UNAVAILABLE (the role died,
    restarts, or every replica is down), for at most `bound_s` seconds from the first failure;
    every other attribute is the inner client's (the replicated reward's `add`, `retire`, ...)."""

    def __init__(self, inner: Any, role: str, bound_s: float, key: str, methods: tuple[str, ...] = ("score",),
                 clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S):
        self.inner, self.role, self.bound_s, self.key = inner, role, bound_s, key
        self.methods, self.clock, self.poll_s = methods, clock, poll_s
        self.repeated = 0  # calls sent again after a failure: what the role's loss cost

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.methods:
            return attr

        async def repeated(*args, **kwargs):  # a coroutine function, as the busy clock times them
            return await self._until_back(name, lambda: attr(*args, **kwargs))

        return repeated

    async def _until_back(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        deadline = None
        while True:
            try:
                return await call()
            except Unavailable as exc:
                now = self.clock()
                if deadline is None:  # this call's first failure: said once
                    deadline = now + self.bound_s
                    log.warning("%s.%s failed (%s); the %s holds no training state: waiting up to %g s (%s) for "
                                "it to answer, then repeating the call", self.role, name, exc, self.role,
                                self.bound_s, self.key)
                if now >= deadline:
                    raise FailedPrecondition(
                        f"the {self.role} role has not answered {name} for {self.bound_s:g} s ({self.key}): {exc}"
                    ) from exc
                self.repeated += 1
                await asyncio.sleep(self.poll_s)

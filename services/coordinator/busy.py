"""How busy each role is, seen from the coordinator: the time during which at least one call to
the role was in flight (overlapping calls count once: a role with work queued behind its model
lock is busy). Both loops wrap their role clients in `BusyClock.track`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections import defaultdict
from dataclasses import fields, replace

from rolefleet.coordinator.call_trace import CallTrace


class BusyClock:
    def __init__(self, trace: CallTrace | None = None):
        self.trace = trace  # `run.call_trace`: each call also as a slice on a timeline
        self._mark = time.perf_counter()
        self._marked: dict[str, float] = {}  # busy seconds per role at the mark
        self._active: dict[str, int] = defaultdict(int)
        self._since: dict[str, float] = {}
        self._total: dict[str, float] = defaultdict(float)

    def enter(self, role: str) -> None:
        if self._active[role] == 0:
            self._since[role] = time.perf_counter()
        self._active[role] += 1

    def leave(self, role: str) -> None:
        self._active[role] -= 1
        if self._active[role] == 0:
            self._total[role] += time.perf_counter() - self._since.pop(role)

    def fractions(self) -> dict[str, float]:
        """`busy/<role>`: the share of the time since the last call (the previous step's record)
        during which the role was busy."""
        now = time.perf_counter()
        busy = dict(self._total)
        for role, since in self._since.items():  # calls in flight count up to now
            busy[role] = busy.get(role, 0.0) + now - since
        window = max(now - self._mark, 1e-9)
        out = {f"busy/{role}": (seconds - self._marked.get(role, 0.0)) / window for role, seconds in sorted(busy.items())}
        self._mark, self._marked = now, busy
        return out

    @contextlib.contextmanager
    def span(self, what: str):
        """The coordinator itself waiting or working (`what`: on what), a slice on the call trace's
        `coordinator.<what>` track; nothing without a trace."""
        call = self.trace.begin("coordinator", what) if self.trace else None
        try:
            yield
        finally:
            if call is not None:
                self.trace.end(call)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()

    def track(self, roles):
        """The same Roles, each client's coroutine methods timed under its field name."""
        return replace(roles, **{f.name: _Tracked(getattr(roles, f.name), f.name, self)
                                 for f in fields(roles) if getattr(roles, f.name) is not None})


class _Tracked:
    def __init__(self, inner, role: str, clock: BusyClock):
        self._inner, self._role, self._clock = inner, role, clock

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if inspect.isasyncgenfunction(attr):  # a stream: busy from the call to its last item
            async def streamed(*args, **kwargs):
                with self._timing(name):
                    async for item in attr(*args, **kwargs):
                        yield item

            return streamed
        if not asyncio.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)  # keeps the method's name: the retry policy's messages name it
        async def timed(*args, **kwargs):
            with self._timing(name):
                return await attr(*args, **kwargs)

        return timed

    @contextlib.contextmanager
    def _timing(self, method: str):
        trace = self._clock.trace
        self._clock.enter(self._role)
        call = trace.begin(self._role, method) if trace else None
        error = None
        try:
            yield
        except GeneratorExit:  # a stream closed by its reader: no error
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._clock.leave(self._role)
            if call is not None:
                trace.end(call, error)

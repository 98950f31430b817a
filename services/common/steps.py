"""Idempotency of mutating RPCs: each applied step's result is recorded and replayed on repeats."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Optional, TypeVar

from rolefleet.common.errors import FailedPrecondition, InvalidArgument

R = TypeVar("R")


class StepLedger(Generic[R]):
    """Steps must increase. A repeat of a recorded step returns its result; an older step that was
    never applied (or fell out of the window) is a FAILED_PRECONDITION, never a second update."""

    def __init__(self, role: str, keep: int = 1024):
        self.role = role
        self.keep = keep
        self.results: OrderedDict[int, R] = OrderedDict()
        self.last_step = -1

    def check(self, step: int) -> Optional[R]:
        if step < 0:
            raise InvalidArgument("step", f"must be >= 0, got {step}")
        if step in self.results:
            return self.results[step]
        if step <= self.last_step:
            raise FailedPrecondition(f"{self.role} already moved past step {step} (last applied: {self.last_step})")
        return None

    def record(self, step: int, result: R) -> None:
        self.results[step] = result
        self.last_step = step
        while len(self.results) > self.keep:
            self.results.popitem(last=False)

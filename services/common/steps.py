"""Idempotency of mutating RPCs: each applied step's result is recorded and replayed on repeats."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, Optional, TypeVar

from rolefleet.common.errors import FailedPrecondition, InvalidArgument

R = TypeVar("R")


class PartialUpdate(FailedPrecondition):
    """An update failed after some of its optimizer steps touched the weights."""


class StepLedger(Generic[R]):
    """Steps advance one at a time. A repeat of a recorded step returns its result; any other step
    id (older and unrecorded, or beyond the next one) is a FAILED_PRECONDITION that changes nothing:
    accepting a jump would make the role refuse every later step of the run."""

    def __init__(self, role: str, keep: int = 1024):
        self.role = role
        self.keep = keep
        self.results: OrderedDict[int, R] = OrderedDict()
        self.last_step = 0
        self.broken: Optional[str] = None

    def check(self, step: int) -> Optional[R]:
        """The recorded result of a repeated step, None for the next one, or an error."""
        # Step ids start at 1: 0 is what a client that forgot to set the field sends.
        if step < 1:
            raise InvalidArgument("step", f"must be >= 1, got {step}")
        if step in self.results:
            return self.results[step]
        if self.broken is not None:
            raise FailedPrecondition(f"{self.role} refuses updates until restarted: {self.broken}")
        if step <= self.last_step:
            raise FailedPrecondition(f"{self.role} already moved past step {step} (last applied: {self.last_step})")
        if step != self.last_step + 1:
            raise FailedPrecondition(f"{self.role} expects step {self.last_step + 1} next, got {step}")
        return None

    @contextmanager
    def applying(self, step: int) -> Iterator[None]:
        """Wrap the work of a new step: a PartialUpdate inside leaves the weights neither old nor
        new, so every later update is refused until the role is restarted."""
        try:
            yield
        except PartialUpdate as exc:
            self.broken = f"the update of step {step} {exc}"
            raise

    def record(self, step: int, result: R) -> None:
        self.results[step] = result
        self.last_step = step
        while len(self.results) > self.keep:
            self.results.popitem(last=False)

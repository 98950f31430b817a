"""Idempotency of mutating RPCs: each applied step's result is recorded and replayed on repeats."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Optional, TypeVar

from rolefleet.common import metrics
from rolefleet.common.errors import FailedPrecondition, InvalidArgument
from rolefleet.common.role_types import UpdateResult

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


class TrainerState:
    """The one update flow of a trainer role (actor and critic): the model lock, the step ledger
    and the model version, moved together.

    Under the lock, a recorded step replays its result (after checking that it is the same
    request: the same input version); a new step must be the ledger's next one and, when the role
    fences by version, come from the current version; it trains inside the ledger's `applying`
    (a partial update blocks the role), is recorded, and only then moves the version, so a
    lock-free status never shows a version ahead of its step.
    """

    def __init__(self, role: str, versioned: str = "policy"):
        self.role = role
        self.versioned = versioned  # what the fence's input version is a version of (actor: the policy)
        self.lock = threading.Lock()  # one model, one caller at a time
        self.ledger: StepLedger = StepLedger(role)
        self.version = 0

    def update(self, step: int, input_version: Optional[int], train: Callable[[], dict[str, float]],
               max_lag: int = 0):
        """Apply `train()` as step `step`; `input_version` (None: no fence) is the version that
        produced the batch's oldest sample, which may lag this role's version by up to `max_lag`
        (the async pipeline's `max_staleness`). Returns the UpdateResult, recorded or replayed."""
        with self.lock:
            done = self.ledger.check(step)
            if done is not None:
                result, recorded_version = done
                if input_version is not None and input_version != recorded_version:
                    # Same step id, other batch: a new run against a used role, not a retry.
                    raise FailedPrecondition(f"step {step} was already applied to a batch of {self.versioned} version "
                                             f"{recorded_version}, not {input_version}")
                return result
            if input_version is not None:
                lag = self.version - input_version
                if lag < 0:
                    raise FailedPrecondition(f"batch claims {self.versioned} version {input_version}; "
                                             f"{self.role} is only at {self.version}")
                if lag > max_lag:
                    raise FailedPrecondition(
                        f"batch's oldest sample is from {self.versioned} version {input_version}, {lag} behind the "
                        f"{self.role}'s {self.version}: more than pipeline.max_staleness={max_lag}"
                        if max_lag else f"batch was generated by {self.versioned} version {input_version}, "
                        f"{self.role} is at {self.version}")
            with self.ledger.applying(step):
                stats = train()
            result = UpdateResult(step=step, model_version=self.version + 1, stats=stats)
            self.ledger.record(step, (result, input_version))
            self.version += 1
        metrics.MODEL_VERSION.labels(self.role).set(self.version)
        metrics.TRAIN_STEPS.labels(self.role).inc()
        return result

    # --- checkpoints (trainer/checkpoint.py) ------------------------------------------------------

    def to_json(self, keep: int = 16) -> dict:
        """Version, last step and the newest recorded results: a retried update after a restart is
        still answered from the ledger."""
        results = list(self.ledger.results.items())[-keep:]
        return {"model_version": self.version, "last_step": self.ledger.last_step,
                "results": [{"step": step, "model_version": result.model_version, "stats": result.stats,
                             "input_version": input_version} for step, (result, input_version) in results]}

    def restore(self, saved: dict) -> None:
        self.ledger = StepLedger(self.role)
        for entry in saved["results"]:
            result = UpdateResult(step=entry["step"], model_version=entry["model_version"], stats=entry["stats"])
            self.ledger.record(entry["step"], (result, entry["input_version"]))
        self.ledger.last_step = saved["last_step"]
        self.version = saved["model_version"]
        metrics.MODEL_VERSION.labels(self.role).set(self.version)

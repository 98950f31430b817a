"""The run's observable state, shared by the loop (writer) and the control planes (gRPC and HTTP)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import IntEnum


class RunState(IntEnum):  # values match rolefleet.v1.RunState
    STARTING = 1
    RUNNING = 2
    STOPPING = 3
    FINISHED = 4
    FAILED = 5
    STOPPED = 6
    PAUSED = 7


ENDED = (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)


class ControlError(Exception):
    """A control request the run's state does not allow (the run already ended, say)."""


@dataclass
class RunStatus:
    run_name: str
    total_steps: int
    state: RunState = RunState.STARTING
    step: int = 0
    policy_version: int = 0
    last_reward_mean: float = 0.0
    error: str = ""
    stop_requested: bool = False
    stepping: bool = False  # set once the loop runs steps; before that a stop may cancel at once
    history: list[dict] = field(default_factory=list)  # every step's record, as in metrics.jsonl
    _resumed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def record_step(self, record: dict, policy_version: int) -> None:
        self.step, self.policy_version = record["step"], policy_version
        self.last_reward_mean = record.get("reward/mean", 0.0)  # (supervised steps have no reward)
        self.history.append(record)

    def record_eval(self, record: dict) -> None:
        """The record of an evaluation alone (step 0): in the history, no step done."""
        self.history.append(record)

    def rewind(self, records: list[dict]) -> None:
        """Resuming or recovering: the steps after a checkpoint are run again."""
        self.history = list(records)
        steps = [r for r in records if "timing/step_s" in r]  # not an evaluation's record alone
        last = steps[-1] if steps else {"step": 0, "policy_version": 0, "reward/mean": 0.0}
        self.step, self.policy_version = last["step"], last.get("policy_version", 0)
        self.last_reward_mean = last.get("reward/mean", 0.0)

    def request_stop(self) -> bool:
        """Ask the run to stop after the step in flight. True when it has not started stepping, so
        it may be cancelled at once (nothing to leave consistent)."""
        self.stop_requested = True
        if self.state in (RunState.STARTING, RunState.RUNNING, RunState.PAUSED):
            self.state = RunState.STOPPING
        self._resumed.set()  # a paused loop wakes up to see the stop
        return not self.stepping

    def pause(self) -> None:
        """No new step (or, in async mode, no new rollout batch) starts until `resume`; the work in
        flight finishes. Pausing a paused run changes nothing."""
        if self.state in ENDED or self.stop_requested:
            raise ControlError(f"the run is {self.state.name.lower()}: there is nothing to pause")
        self._resumed.clear()
        self.state = RunState.PAUSED

    def resume(self) -> None:
        """Let steps start again. Resuming a run that is not paused changes nothing."""
        if self.state in ENDED or self.stop_requested:
            raise ControlError(f"the run is {self.state.name.lower()}: there is nothing to resume")
        if self.paused:
            self.state = RunState.RUNNING if self.stepping else RunState.STARTING
            self._resumed.set()

    async def wait_resumed(self) -> None:
        """Returns at once unless the run is paused; a stop request also ends the wait."""
        await self._resumed.wait()

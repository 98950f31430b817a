"""The run's observable state, shared by the loop (writer) and the control plane (reader)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class RunState(IntEnum):  # values match rolefleet.v1.RunState
    STARTING = 1
    RUNNING = 2
    STOPPING = 3
    FINISHED = 4
    FAILED = 5
    STOPPED = 6


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

    def request_stop(self) -> bool:
        """Ask the run to stop after the step in flight. True when it has not started stepping, so
        it may be cancelled at once (nothing to leave consistent)."""
        self.stop_requested = True
        if self.state in (RunState.STARTING, RunState.RUNNING):
            self.state = RunState.STOPPING
        return not self.stepping

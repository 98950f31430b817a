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

    def request_stop(self) -> None:
        self.stop_requested = True
        if self.state in (RunState.STARTING, RunState.RUNNING):
            self.state = RunState.STOPPING

"""Which of the actor's worker ranks train and which generate (`devices.rollout`, DESIGN "Process
model").

Colocated (no `devices.rollout`, or all of the actor's GPUs): every rank trains and generates; the
engine sleeps during training and takes the new weights in place. Split (`devices.rollout` a proper
subset of `devices.actor`, or `actor.rollout.workers` below `actor.workers` on the CPU): the rollout
ranks only generate and the others only train, each part in its own process group, so generation
and training run at the same time; after every update the first training rank broadcasts the new
weights to the rollout ranks (`weight_sync.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rolefleet.common.config import RoleFleetConfig


@dataclass(frozen=True)
class ActorPlacement:
    world: int
    rollout: tuple[int, ...] = ()  # ranks that generate when split; () or every rank: colocated

    @property
    def split(self) -> bool:
        return 0 < len(self.rollout) < self.world

    @property
    def rollout_ranks(self) -> list[int]:
        return list(self.rollout) if self.split else list(range(self.world))

    @property
    def train_ranks(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.rollout] if self.split else list(range(self.world))

    @property
    def sync_ranks(self) -> list[int]:
        """The first training rank, which sends the weights, and the rollout ranks."""
        return sorted([self.train_ranks[0], *self.rollout_ranks])

    def describe(self) -> str:
        if not self.split:
            return f"{self.world} workers, each training and generating"
        return f"{len(self.train_ranks)} training workers (ranks {self.train_ranks}), {len(self.rollout)} " \
               f"rollout workers (ranks {list(self.rollout)})"


def rollout_ranks(cfg: RoleFleetConfig) -> tuple[int, ...]:
    """The ranks of `devices.rollout` within `devices.actor` (rank i drives the i-th GPU of the
    group), or the first `actor.rollout.workers` ranks of a CPU group."""
    actor = [str(d) for d in cfg.devices.actor]
    if cfg.devices.rollout:
        return tuple(sorted(actor.index(str(d)) for d in cfg.devices.rollout))
    return tuple(range(cfg.actor.rollout.workers or 0))

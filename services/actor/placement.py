"""Which of the actor's worker ranks train and which generate (`devices.rollout`, DESIGN "Process
model").

Colocated (no `devices.rollout`, or all of the actor's GPUs): every rank trains and generates; the
engine sleeps during training and takes the new weights in place. Split (`devices.rollout` a proper
subset of `devices.actor`, or `actor.rollout.workers` below `actor.workers` on the CPU): the rollout
ranks only generate and the others only train, each part in its own process group, so generation
and training run at the same time; after every update the first training rank broadcasts the new
weights to the rollout ranks (`weight_sync.py`; with vLLM, `vllm_sync.py` straight into the engines).

Rollout engines: with the hf backend every rollout rank runs one. vLLM's engine may span several GPUs
(`actor.rollout.vllm.tensor_parallel_size`): the rollout ranks form engines of that many consecutive
ranks, and the first of each drives it (`engine_ranks`); the others hold their GPU for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rolefleet.common.config import ActorSection, RoleFleetConfig


@dataclass(frozen=True)
class ActorPlacement:
    world: int
    rollout: tuple[int, ...] = ()  # ranks that generate when split; () or every rank: colocated
    engine_size: int = 1  # GPUs (ranks) per rollout engine

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
    def engine_ranks(self) -> list[int]:
        """The rollout ranks that drive an engine: every rollout rank, or the first of each engine's."""
        return self.rollout_ranks[::self.engine_size]

    def engine_members(self, rank: int) -> list[int]:
        """The ranks (one GPU each) whose GPUs the engine driven by `rank` spans."""
        ranks = self.rollout_ranks
        start = ranks.index(rank)
        return ranks[start:start + self.engine_size]

    @property
    def sync_ranks(self) -> list[int]:
        """The first training rank, which sends the weights, and the rollout ranks."""
        return sorted([self.train_ranks[0], *self.rollout_ranks])

    def describe(self) -> str:
        if not self.split:
            return f"{self.world} workers, each training and generating"
        engines = "" if self.engine_size == 1 else \
            f", {len(self.engine_ranks)} engines of {self.engine_size} GPUs (driven by ranks {self.engine_ranks})"
        return f"{len(self.train_ranks)} training workers (ranks {self.train_ranks}), {len(self.rollout)} " \
               f"rollout workers (ranks {list(self.rollout)}{engines})"


def rollout_ranks(cfg: RoleFleetConfig) -> tuple[int, ...]:
    """The ranks of `devices.rollout` within `devices.actor` (rank i drives the i-th GPU of the
    group), or the first `actor.rollout.workers` ranks of a CPU group."""
    actor = [str(d) for d in cfg.devices.actor]
    if cfg.devices.rollout:
        return tuple(sorted(actor.index(str(d)) for d in cfg.devices.rollout))
    return tuple(range(cfg.actor.rollout.workers or 0))


def engine_size(cfg: ActorSection, backend: str, placement: ActorPlacement) -> int:
    """GPUs per rollout engine (`actor.rollout.vllm.tensor_parallel_size`). Raises ValueError naming
    the key where it cannot apply: engines of several GPUs are vLLM's, on rollout GPUs of their own."""
    size = cfg.rollout.vllm.tensor_parallel_size
    if size == 1:
        return 1
    key = "actor.rollout.vllm.tensor_parallel_size"
    if backend != "vllm" or not placement.split:
        raise ValueError(f"{key}: engines of {size} GPUs need actor.rollout.backend=vllm and the actor's rollout "
                         "GPUs apart from its training GPUs (devices.rollout, a part of devices.actor)")
    if len(placement.rollout_ranks) % size:
        raise ValueError(f"{key}: the {len(placement.rollout_ranks)} rollout GPUs (devices.rollout) do not form "
                         f"engines of {size} GPUs")
    return size

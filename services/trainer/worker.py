"""What every trainer role's worker (one per rank: `actor/worker.py`, `critic/worker.py`) does alike
around its trainer: profile and count the compiles of its updates, save and load the trainer's
state, digest its weights. The methods are collective over the worker's training ranks
(`trainer/workers.py`); a worker whose rank does not train (an actor's rollout worker) has no
trainer and is never asked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from rolefleet.common.modeling import pick_device
from rolefleet.trainer.base import Trainer
from rolefleet.trainer.profiling import DeviceMemory, NewGraphs, profiled
from rolefleet.trainer.ranks import Ranks
from rolefleet.trainer.workers import collective, join_alone

T = TypeVar("T")


class TrainingWorker:
    role: str
    cfg: object  # the role's config section (its `profile_updates`, `profile_dir`)
    rank: int  # in the role's whole group
    ranks: Ranks  # the training part's
    trainer: Trainer | None
    parts: dict[str, list[int]]

    def __init__(self, cfg, seed: int) -> None:
        """What every rank does first: its device, its seed, and for `<role>.offload=params` a process
        group (FSDP2's CPU offload shards over one, even of this process alone)."""
        self.cfg = cfg
        self.updates_run = 0  # by this process: what `<role>.profile_updates` counts
        self.new_graphs = NewGraphs(self.role)
        self.device = pick_device()
        torch.manual_seed(seed)
        if cfg.offload == "params":
            join_alone()

    def profiled_update(self, train: Callable[[], tuple[dict, T]]) -> tuple[dict, T]:
        """`train()` (statistics and anything else) under the profiler when this update is one of
        `<role>.profile_updates`; adds `compiled_graphs` (summed over the training ranks),
        `compile_seconds` (the most a rank spent compiling) and on CUDA the update's
        `peak_memory_gib` and `memory_gib` (the most of any rank)."""
        self.updates_run += 1
        DeviceMemory.start()
        with profiled(self.role, self.updates_run, self.cfg.profile_updates, self.cfg.profile_dir, self.rank):
            stats, extra = train()
        stats.update(self.new_graphs.take_over_ranks(self.ranks))
        return stats, extra

    @collective("trainers")
    def save_state(self, work: str, buffers: str | None = None) -> None:
        self.trainer.save_state(Path(work), None if buffers is None else Path(buffers))

    @collective("trainers")
    def load_state(self, path: str) -> None:
        self.trainer.load_state(Path(path))

    @collective("trainers")
    def keep_snapshot(self, path: str) -> None:
        self.trainer.keep_snapshot(Path(path))

    @collective("trainers")
    def digest(self) -> str:
        return self.trainer.digest()

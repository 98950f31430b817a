"""CriticCore: the critic role without gRPC, a controller over its workers (`critic/worker.py`):
value predictions and value-loss updates. Tests drive it in-process; the servicer wraps it."""

from __future__ import annotations

import torch

from rolefleet.common import metrics
from rolefleet.common.batch import BatchLimits, SequenceBatch
from rolefleet.common.config import CriticSection
from rolefleet.common.role_types import UpdateResult
from rolefleet.critic.worker import ROLE, CriticWorker
from rolefleet.trainer import checkpoint
from rolefleet.trainer.role import TrainerRole
from rolefleet.trainer.workers import WorkerGroup


class CriticCore(TrainerRole):
    def __init__(self, cfg: CriticSection, seed: int = 0, max_staleness: int = 0, group: WorkerGroup | None = None):
        """`group`: the other worker processes, when the critic runs over several (`serve` starts them)."""
        self.cfg = cfg
        self.max_staleness = max_staleness  # versions an Update's values may lag (pipeline.max_staleness)
        worker = CriticWorker(cfg, seed)
        # Update's fence: the version of the critic that computed its old values.
        super().__init__(ROLE, worker, group, versioned="value-model")
        self.vocab_size = worker.model.vocab_size
        self.limits = BatchLimits.of(ROLE, cfg, worker.model.max_positions)

    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """float32 [N], micro-batch by micro-batch."""
        return self.versioned_values(batch)[0]

    def versioned_values(self, batch: SequenceBatch) -> tuple[torch.Tensor, int]:
        """The values and the version that computed them (read under the same lock)."""
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        with self._lock:
            return self.workers.run(CriticWorker.compute_values, batch), self.state.version

    def update(self, step: int, batch: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor,
               values_version: int | None = None) -> UpdateResult:
        """Value-loss epochs over mini-batches. A repeat of an applied step returns its recorded result.
        `values_version`: the critic version that computed `old_values` (None: no fence)."""
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        batch.check_per_token(returns, "returns", "target")
        batch.check_per_token(old_values, "old_values", "target")

        def train() -> dict[str, float]:
            stats = self.workers.run(CriticWorker.train, batch, returns, old_values)
            metrics.COMPILED_GRAPHS.labels(ROLE).inc(stats["compiled_graphs"])
            return stats

        return self.state.update(step, values_version, train, max_lag=self.max_staleness)

    @property
    def model_version(self) -> int:
        return self.state.version

    def write_hf_files(self, work) -> None:
        checkpoint.save_hf_files(work, self.worker.model.backbone.config)

"""The critic's worker: one per rank of its group, each with the value model (its shards, if
sharded) and its trainer. Every method is collective over all of the critic's ranks."""

from __future__ import annotations

import torch

from rolefleet.common.config import CriticSection, RoleFleetConfig
from rolefleet.critic.model import ValueModel
from rolefleet.critic.trainer import ValueTrainer
from rolefleet.trainer.ranks import Ranks, global_world
from rolefleet.trainer.sharding import sharding_wanted
from rolefleet.trainer.worker import TrainingWorker
from rolefleet.trainer.workers import collective

ROLE = "critic"


class CriticWorker(TrainingWorker):
    role = ROLE

    def __init__(self, cfg: CriticSection, seed: int = 0):
        super().__init__(cfg, seed)
        self.ranks = Ranks.of(None)  # every rank trains
        self.rank = self.ranks.rank
        self.parts = dict.fromkeys(("all", "trainers"), list(range(global_world())))
        # Adapters are injected into whole weights: a LoRA critic loads whole (`trainer.loading`).
        on_meta = sharding_wanted(cfg, self.ranks) and not cfg.lora.enabled
        self.model = ValueModel(cfg.model_name_or_path, self.device, on_meta=on_meta,
                                trust_remote_code=bool(cfg.trust_remote_code))
        self.model.eval()
        self.trainer = ValueTrainer(self.model, self.device, cfg, seed, self.ranks)

    @classmethod
    def from_config(cls, cfg: RoleFleetConfig) -> CriticWorker:
        return cls(cfg.critic, seed=cfg.run.seed)

    @collective("trainers")
    def compute_values(self, batch) -> torch.Tensor:
        return self.trainer.values(batch)

    @collective("trainers")
    def train(self, batch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        return self.profiled_update(lambda: (self.trainer.update(batch, returns, old_values), None))[0]

    def close(self) -> None:
        self.trainer = self.model = None

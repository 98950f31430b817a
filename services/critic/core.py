"""CriticCore: value predictions and value-loss updates, without gRPC."""

from __future__ import annotations

import threading

import torch

from rolefleet.algos import VALUE_LOSSES
from rolefleet.common import metrics
from rolefleet.common.batch import BatchLimits, SequenceBatch
from rolefleet.common.config import CriticSection
from rolefleet.common.modeling import pick_device, release_memory, weights_digest
from rolefleet.common.roles import UpdateResult
from rolefleet.common.steps import StepLedger
from rolefleet.common.training import optimizer_step, run_epochs
from rolefleet.critic.model import ValueModel

ROLE = "critic"


class CriticCore:
    def __init__(self, cfg: CriticSection, seed: int = 0):
        self.cfg = cfg
        self.device = pick_device()
        torch.manual_seed(seed)
        self.model = ValueModel(cfg.model_name_or_path).to(self.device)
        self.model.eval()
        self.limits = BatchLimits.of(ROLE, cfg, self.model.max_positions)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.value_loss = VALUE_LOSSES.get("clipped_mse")
        self.generator = torch.Generator().manual_seed(seed)
        self.model_version = 0
        self.ledger: StepLedger[UpdateResult] = StepLedger(ROLE)
        self._lock = threading.Lock()

    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """float32 [N]."""
        batch.check_limits(self.limits, vocab_size=self.model.vocab_size)
        with self._lock, torch.no_grad():
            return self.model.response_values(batch, self.device).cpu()

    def update(self, step: int, batch: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor) -> UpdateResult:
        """Value-loss epochs over mini-batches. A repeat of an applied step returns its recorded result."""
        batch.check_limits(self.limits, vocab_size=self.model.vocab_size)
        batch.check_per_token(returns, "returns", "target")
        batch.check_per_token(old_values, "old_values", "target")
        with self._lock:
            done = self.ledger.check(step)
            if done is not None:
                return done

            def train_step(mb: SequenceBatch, tokens: torch.Tensor) -> dict[str, float]:
                values = self.model.response_values(mb, self.device)
                loss, stats = self.value_loss(values, old_values[tokens].to(self.device),
                                              returns[tokens].to(self.device), torch.ones_like(values),
                                              self.cfg.value_clip)
                grad_norm = optimizer_step(self.model, self.optimizer, loss, self.cfg.max_grad_norm)
                return {"vf_loss": loss.item(), "vf_grad_norm": grad_norm,
                        **{k: v.item() for k, v in stats.items()}}

            self.model.train()
            try:
                with self.ledger.applying(step):
                    stats = run_epochs(batch, self.cfg.ppo_epochs, self.cfg.num_mini_batches, self.generator,
                                       train_step)
            finally:
                self.model.eval()
            self.model_version += 1
            result = UpdateResult(step=step, model_version=self.model_version, stats=stats)
            self.ledger.record(step, result)
        metrics.MODEL_VERSION.labels(ROLE).set(self.model_version)
        metrics.TRAIN_STEPS.labels(ROLE).inc()
        return result

    def digest(self) -> str:
        with self._lock:
            return weights_digest(self.model)

    def close(self) -> None:
        with self._lock:
            del self.model, self.optimizer
        release_memory()

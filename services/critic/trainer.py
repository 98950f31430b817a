"""Value trainer: value predictions and clipped value-loss updates (`trainer/base.py` does the
optimizer steps).

The value loss is a mean over the mini-batch's response tokens, so each micro-batch weighs by its
share of them. The scalar head stays fp32 under bf16 autocast (sharded, it is a unit of its own).
With `critic.lora`, adapters in the backbone and the head train; the backbone's weights stay frozen.
"""

from __future__ import annotations

import torch

from rolefleet.algos import VALUE_LOSSES
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import CriticSection
from rolefleet.common.modeling import compute_dtype
from rolefleet.critic.model import ValueModel
from rolefleet.trainer.base import Trainer
from rolefleet.trainer.lora import Adapters
from rolefleet.trainer.ranks import Ranks
from rolefleet.trainer.sharding import sharding_wanted


class ValueTrainer(Trainer):
    stat_prefix = "vf_"

    def __init__(self, model: ValueModel, device: torch.device, cfg: CriticSection, seed: int,
                 ranks: Ranks | None = None):
        ranks = ranks or Ranks.alone()
        self.adapters = None
        if cfg.lora.enabled:  # before the trainer shards and builds its optimizer: adapters and head train
            frozen_dtype = None if sharding_wanted(cfg, ranks) else compute_dtype(device, cfg.compute_dtype)
            self.adapters = Adapters(model.backbone, cfg.lora, frozen_dtype, role="critic")
        super().__init__(model, model, model.backbone, cfg, device, ranks, seed, full_precision=(model.head,))
        self.value_loss = VALUE_LOSSES.get("clipped_mse")
        values = lambda mb: self.model(mb, self.device, self.packed, self.attention)  # noqa: E731
        self.warm_compile([(True, values), (False, values)])  # the update, ComputeValues

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """float32 [N], each rank its share of the micro-batches, gathered in token order."""
        (values,) = self.map_micro_batches(batch, lambda mb: (self.model(mb, self.device, self.packed, self.attention),))
        return values

    def update(self, batch: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """Value-loss epochs over mini-batches (every rank the same ones: the same generator), each
        statistic averaged over the optimizer steps."""
        return self.run_epochs(batch, lambda mb, tokens: self._step(mb, returns[tokens], old_values[tokens]))

    def _step(self, mb: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        def micro_loss(rows: torch.Tensor, real: bool) -> tuple[torch.Tensor, dict]:
            tokens = mb.token_index(rows)
            with self.autocast():
                values = self.model(mb.select(rows), self.device, self.packed, self.attention)
            # Observation tokens of a multi-turn response are no state of the model's: not fitted.
            fitted = torch.ones_like(values, dtype=torch.bool) if own is None else own[tokens].to(self.device)
            loss, stats = self.value_loss(values, old_values[tokens].to(self.device), returns[tokens].to(self.device),
                                          fitted, self.cfg.value_clip)
            return loss, {"vf_loss": loss.detach(), "vf_clipfrac": stats["vf_clipfrac"]}

        own = mb.loss_mask  # None: every response token is the model's (single-turn)
        if own is None:
            micro = [(rows, len(mb.token_index(rows)) / mb.num_response_tokens) for rows in self.micro_batches(mb)]
        else:
            total = max(int(own.sum()), 1)
            micro = [(rows, int(own[mb.token_index(rows)].sum()) / total) for rows in self.micro_batches(mb)]
        return self.optimizer_step(micro, micro_loss, {"vf_loss": 0.0, "vf_clipfrac": 0.0})

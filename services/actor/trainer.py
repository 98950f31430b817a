"""Policy trainer: recomputes logprobs and applies PPO updates on packed batches.

Sequences are grouped into mini-batches (one optimizer step each) for `ppo_epochs` passes. Losses
work on packed per-token tensors directly: every packed position is a real token, so the token-mean
needs no mask.
"""

from __future__ import annotations

import torch
from rolefleet.actor.types import LogProbs
from rolefleet.algos import POLICY_LOSSES
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.modeling import entropy, response_logits, token_logprobs
from rolefleet.common.training import optimizer_step, run_epochs
from transformers import PreTrainedModel


class PolicyTrainer:
    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel, device: torch.device,
                 cfg: ActorSection, seed: int):
        self.model = model
        self.ref_model = ref_model
        self.device = device
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.policy_loss = POLICY_LOSSES.get("ppo_clip")
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                         policy_version: int) -> LogProbs:
        self.model.eval()
        logits = response_logits(self.model, batch, self.device)
        targets = batch.response_ids.to(self.device)
        ref = None
        if include_reference:
            ref_logits = response_logits(self.ref_model, batch, self.device)
            ref = token_logprobs(ref_logits, targets, temperature).cpu()
        return LogProbs(
            logprobs=token_logprobs(logits, targets, temperature).cpu(),
            ref_logprobs=ref,
            entropy=entropy(logits, temperature).cpu(),
            policy_version=policy_version,
        )

    def update(self, batch: SequenceBatch, advantages: torch.Tensor, old_logprobs: torch.Tensor,
               temperature: float) -> dict[str, float]:
        """PPO epochs over mini-batches; returns the mean of each statistic over optimizer steps."""
        def step(mb: SequenceBatch, tokens: torch.Tensor) -> dict[str, float]:
            return self._step(mb, advantages[tokens], old_logprobs[tokens], temperature)

        self.model.train()
        try:
            return run_epochs(batch, self.cfg.ppo_epochs, self.cfg.num_mini_batches, self.generator, step)
        finally:
            self.model.eval()

    def _step(self, mb: SequenceBatch, advantages: torch.Tensor, old_logprobs: torch.Tensor,
              temperature: float) -> dict[str, float]:
        logits = response_logits(self.model, mb, self.device)
        logprobs = token_logprobs(logits, mb.response_ids.to(self.device), temperature)
        loss, stats = self.policy_loss(
            logprobs, old_logprobs.to(self.device), advantages.to(self.device), torch.ones_like(logprobs),
            self.cfg.clip_ratio,
        )
        grad_norm = optimizer_step(self.model, self.optimizer, loss, self.cfg.max_grad_norm)
        with torch.no_grad():
            ent = entropy(logits, temperature).mean()
        return {"pg_loss": loss.item(), "grad_norm": grad_norm, "entropy": ent.item(),
                **{k: v.item() for k, v in stats.items()}}

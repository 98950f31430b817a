"""Policy trainer: recomputes logprobs and applies policy-gradient updates.

Sequences are grouped into mini-batches (one optimizer step each) for `ppo_epochs` passes. Each
mini-batch's packed per-token tensors are padded to [b, T] only around the pure loss functions,
which take a mask. The loss: the configured policy loss (optionally importance-weighted against the
rollout engine) - entropy_coef * entropy + kl_loss_coef * KL(policy || reference), all aggregated
the same way.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rolefleet.actor.types import LogProbs, PolicyTargets
from rolefleet.algos import IS_CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, aggregate, entropy_from_logits
from rolefleet.algos.functional import masked_mean
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.modeling import response_logits, token_logprobs
from rolefleet.common.training import optimizer_step, run_epochs


class PolicyTrainer:
    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel, device: torch.device,
                 cfg: ActorSection, seed: int):
        self.model = model
        self.ref_model = ref_model
        self.device = device
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.policy_loss = POLICY_LOSSES.get(cfg.policy_loss)
        self.is_correction = IS_CORRECTIONS.get(cfg.is_correction)
        self.kl_loss = KL_ESTIMATORS.get(cfg.kl_loss_estimator)
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                         policy_version: int) -> LogProbs:
        self.model.eval()
        logits = response_logits(self.model, batch, self.device) / temperature
        targets = batch.response_ids.to(self.device)
        ref = None
        if include_reference:
            ref_logits = response_logits(self.ref_model, batch, self.device) / temperature
            ref = token_logprobs(ref_logits, targets, 1.0).cpu()
        return LogProbs(
            logprobs=token_logprobs(logits, targets, 1.0).cpu(),
            ref_logprobs=ref,
            entropy=entropy_from_logits(logits).cpu(),
            policy_version=policy_version,
        )

    def update(self, batch: SequenceBatch, targets: PolicyTargets, temperature: float) -> dict[str, float]:
        """Policy-loss epochs over mini-batches; returns each statistic averaged over optimizer steps."""
        def step(mb: SequenceBatch, tokens: torch.Tensor) -> dict[str, float]:
            def part(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else mb.pad_responses(x[tokens]).to(self.device)

            return self._step(mb, part(targets.advantages), part(targets.old_logprobs),
                              part(targets.ref_logprobs), part(targets.rollout_logprobs), temperature)

        self.model.train()
        try:
            return run_epochs(batch, self.cfg.ppo_epochs, self.cfg.num_mini_batches, self.generator, step)
        finally:
            self.model.eval()

    def _step(self, mb: SequenceBatch, advantages: torch.Tensor, old_logprobs: torch.Tensor,
              ref_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor | None,
              temperature: float) -> dict[str, float]:
        cfg, mask = self.cfg, mb.response_mask().to(self.device)
        logits = response_logits(self.model, mb, self.device) / temperature
        logprobs = mb.pad_responses(token_logprobs(logits, mb.response_ids.to(self.device), 1.0))
        weights, stats = None, {}
        if rollout_logprobs is not None:
            weights, mask = self.is_correction(old_logprobs, rollout_logprobs, mask, cfg.is_threshold)
            stats["is_weight_mean"] = masked_mean(weights, mask).item()
            stats["is_masked_frac"] = 1.0 - (mask.sum() / mb.response_lengths.sum().clamp(min=1)).item()
        loss, pg_stats = self.policy_loss(
            logprobs, old_logprobs, advantages, mask, clip_low=cfg.clip_ratio, clip_high=cfg.clip_ratio_high,
            dual_clip=cfg.dual_clip, agg=cfg.loss_agg_mode, weights=weights, norm_length=cfg.loss_norm_length,
        )
        stats["pg_loss"] = loss.item()
        # Entropy over the vocabulary is costly to differentiate: keep its graph only when it is a loss term.
        with torch.set_grad_enabled(cfg.entropy_coef > 0):
            entropy = mb.pad_responses(entropy_from_logits(logits))
            entropy_term = aggregate(entropy, mask, cfg.loss_agg_mode, cfg.loss_norm_length)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy_term
        if cfg.kl_loss_coef > 0:
            kl = aggregate(self.kl_loss(logprobs, ref_logprobs), mask, cfg.loss_agg_mode, cfg.loss_norm_length)
            loss = loss + cfg.kl_loss_coef * kl
            stats["kl_loss"] = kl.item()
        stats["loss"] = loss.item()
        stats["grad_norm"] = optimizer_step(self.model, self.optimizer, loss, cfg.max_grad_norm)
        stats["entropy"] = entropy_term.item()
        return {**stats, **{k: v.item() for k, v in pg_stats.items()}}

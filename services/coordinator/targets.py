"""Step targets for PPO: token rewards (score at the last token, minus the KL penalty), GAE
advantages and returns. Works on packed per-token tensors; pads only around the pure functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rolefleet.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from rolefleet.algos.functional import masked_whiten
from rolefleet.common.batch import SequenceBatch


@dataclass(frozen=True)
class Targets:
    advantages: torch.Tensor  # float32 [N]
    returns: torch.Tensor     # float32 [N]
    kl: torch.Tensor          # float32 [N], per-token KL estimate to the reference


def ppo_targets(batch: SequenceBatch, scores: torch.Tensor, values: torch.Tensor, logprobs: torch.Tensor,
                ref_logprobs: torch.Tensor, gamma: float, lam: float, kl_coef: float, kl_estimator: str,
                whiten: bool) -> Targets:
    """scores [B]; values, logprobs, ref_logprobs packed [N]."""
    mask = batch.response_mask()
    kl = KL_ESTIMATORS.get(kl_estimator)(logprobs, ref_logprobs)
    token_rewards = batch.pad_responses(-kl_coef * kl)
    last = batch.response_lengths - 1
    token_rewards[torch.arange(len(batch)), last] += scores
    advantages, returns = ADVANTAGE_ESTIMATORS.get("gae")(
        token_rewards, batch.pad_responses(values), mask, gamma=gamma, lam=lam
    )
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return Targets(batch.pack_responses(advantages), batch.pack_responses(returns), kl)

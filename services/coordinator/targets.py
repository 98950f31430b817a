"""Step targets: token rewards (score on the last token minus the KL penalty), then the algorithm's
advantage estimator. Batches stay packed; tensors are padded only around the pure functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolefleet.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from rolefleet.algos.functional import masked_whiten
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import TrainSection


@dataclass(frozen=True)
class Targets:
    advantages: torch.Tensor  # float32 [N]
    returns: torch.Tensor     # float32 [N]
    kl: torch.Tensor          # float32 [N], per-token KL estimate to the reference


def step_targets(estimator: str, batch: SequenceBatch, scores: torch.Tensor, values: torch.Tensor,
                 logprobs: torch.Tensor, ref_logprobs: torch.Tensor, group_ids: torch.Tensor, kl_coef: float,
                 train: TrainSection) -> Targets:
    """scores [B]; values, logprobs, ref_logprobs packed [N]; group_ids [B]."""
    mask = batch.response_mask()
    kl = KL_ESTIMATORS.get(train.kl_estimator)(logprobs, ref_logprobs)
    token_rewards = batch.pad_responses(-kl_coef * kl)
    token_rewards[torch.arange(len(batch)), batch.response_lengths - 1] += scores
    # Each estimator takes the inputs its signature declares from these.
    advantages, returns = ADVANTAGE_ESTIMATORS.call(
        estimator, token_rewards=token_rewards, values=batch.pad_responses(values), mask=mask, group_ids=group_ids,
        gamma=train.gamma, lam=train.lam, norm_by_std=train.norm_adv_by_std,
    )
    if train.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return Targets(batch.pack_responses(advantages), batch.pack_responses(returns), kl)

"""Step targets: token rewards (score on the last token minus the KL penalty), then the algorithm's
advantage estimator. Batches stay packed; tensors are padded only around the pure functions."""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class EstimatorInputs:
    token_rewards: torch.Tensor  # [B, T]
    values: torch.Tensor         # [B, T], zeros without a critic
    mask: torch.Tensor           # [B, T]
    group_ids: torch.Tensor      # [B]


# How each registered estimator is called: which inputs and which train.* knobs it takes.
_CALLS: dict[str, Callable[[Callable, EstimatorInputs, TrainSection], tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": lambda f, x, t: f(x.token_rewards, x.values, x.mask, gamma=t.gamma, lam=t.lam),
    "grpo": lambda f, x, t: f(x.token_rewards, x.mask, x.group_ids, norm_by_std=t.norm_adv_by_std),
    "rloo": lambda f, x, t: f(x.token_rewards, x.mask, x.group_ids),
    "reinforce_pp": lambda f, x, t: f(x.token_rewards, x.mask, gamma=t.gamma),
    "reinforce_pp_baseline": lambda f, x, t: f(x.token_rewards, x.mask, x.group_ids),
}


def step_targets(estimator: str, batch: SequenceBatch, scores: torch.Tensor, values: torch.Tensor,
                 logprobs: torch.Tensor, ref_logprobs: torch.Tensor, group_ids: torch.Tensor, kl_coef: float,
                 train: TrainSection) -> Targets:
    """scores [B]; values, logprobs, ref_logprobs packed [N]; group_ids [B]."""
    mask = batch.response_mask()
    kl = KL_ESTIMATORS.get(train.kl_estimator)(logprobs, ref_logprobs)
    token_rewards = batch.pad_responses(-kl_coef * kl)
    token_rewards[torch.arange(len(batch)), batch.response_lengths - 1] += scores
    inputs = EstimatorInputs(token_rewards, batch.pad_responses(values), mask, group_ids)
    advantages, returns = _CALLS[estimator](ADVANTAGE_ESTIMATORS.get(estimator), inputs, train)
    if train.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return Targets(batch.pack_responses(advantages), batch.pack_responses(returns), kl)

"""Advantage estimators. Inputs are right-padded [B, T] per-token tensors with a 0/1 `mask`; outcome
estimators read each response's score as the sum of its token rewards (the score sits on the last
token, plus any per-token KL penalty). Returns (advantages [B, T], returns [B, T]), 0 on padding.

group_ids [B] (int64) mark responses to the same prompt (GRPO, RLOO, REINFORCE++-baseline).
"""

from __future__ import annotations

import torch

from rolefleet.algos.functional import masked_whiten
from rolefleet.algos.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k within each response. [B, T] -> [B, T], 0 on padding."""
    m = mask.to(token_rewards.dtype)
    rewards = token_rewards * m
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * m[:, t]
        returns[:, t] = running
    return returns


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response (group sum, group size, unbiased group std) of `scores` [B]."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    size = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = total / size
    sq = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    return total[inverse], size[inverse], std[inverse]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None] * mask.to(per_seq.dtype)


def _scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_rewards * mask.to(token_rewards.dtype)).sum(-1)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation with a critic. After the last masked token the value is 0
    (terminal). returns = advantages + values."""
    m = mask.to(values.dtype)
    values = values * m
    rewards = token_rewards * m
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Padding holds no state: the running sum is reset there so it cannot leak into real tokens.
        last = (delta + gamma * lam * last) * m[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * m


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised outcome advantage: (score - group mean) / (group std + eps), the same for every
    token of a response. norm_by_std=False gives the Dr. GRPO advantage (no std scaling), which does
    not up-weight prompts whose answers barely differ."""
    scores = _scores(token_rewards, mask)
    total, size, std = _group_stats(scores, group_ids)
    adv = scores - total / size
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: score minus the mean score of the *other* responses to the prompt.
    A response alone in its group has no baseline and gets advantage 0."""
    scores = _scores(token_rewards, mask)
    total, size, _ = _group_stats(scores, group_ids)
    baseline = (total - scores) / (size - 1).clamp(min=1)
    adv = torch.where(size > 1, scores - baseline, torch.zeros_like(scores))
    adv = _broadcast(adv, mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: per-token discounted returns (token-level KL penalty included) whitened over the
    whole batch instead of a critic or group baseline. Returns (whitened, raw returns)."""
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(token_rewards: torch.Tensor, mask: torch.Tensor,
                          group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline: score minus the group mean, broadcast to tokens, then whitened over
    the batch (the batch std, not each group's, so easy prompts are not up-weighted)."""
    scores = _scores(token_rewards, mask)
    total, size, _ = _group_stats(scores, group_ids)
    centred = _broadcast(scores - total / size, mask)
    return masked_whiten(centred, mask), centred

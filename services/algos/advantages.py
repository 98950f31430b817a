"""Advantage estimators: (token rewards, values, mask) -> (advantages, returns), padded [B, T]."""

from __future__ import annotations

import torch
from rolefleet.algos.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each response.

    token_rewards, values, mask: [B, T] (right-padded; mask 1 on real tokens). Each response ends at
    its last masked token, after which the value is 0 (terminal). Returns (advantages, returns), both
    [B, T] and 0 on padding; returns = advantages + values.
    """
    m = mask.to(values.dtype)
    values = values * m
    rewards = token_rewards * m
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        # Padding holds no state: reset the running sum there so it does not leak into real tokens.
        last = last * m[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * m

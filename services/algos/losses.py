"""Policy and value losses. Each returns (scalar loss, stats) with stats as 0-dim tensors."""

from __future__ import annotations

import torch
from rolefleet.algos.functional import masked_mean
from rolefleet.algos.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")
VALUE_LOSSES: Registry = Registry("value loss")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, token-mean over mask. All inputs [B, T] (or packed [N]).

    loss = mean(max(-A * r, -A * clip(r, 1 - eps, 1 + eps))), r = exp(logp - old_logp).
    stats: pg_clipfrac (share of tokens where the clipped branch is taken), ppo_kl (mean old-new).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return loss, stats


@VALUE_LOSSES.register("clipped_mse")
def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), token-mean over mask. Inputs [B, T] or [N]."""
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_err, clipped_err), mask)
    stats = {"vf_clipfrac": masked_mean((clipped_err > unclipped_err).float(), mask).detach()}
    return loss, stats

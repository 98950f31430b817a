"""Importance-sampling correction between the rollout engine and the training engine.

Both engines hold the same weights but compute differently (kernels, precision, or an older policy
in async mode), so tokens were sampled from pi_rollout while the PPO ratio is taken against
pi_old recomputed by the trainer. Weights w = pi_old / pi_rollout correct for that; large weights
are truncated (w -> min(w, C)) or their tokens masked out, at token or sequence level
(sequence: w = prod over the response's tokens, one weight per response).

Each function: (old_logprobs, rollout_logprobs, mask [B, T], threshold C) -> (weights [B, T],
mask [B, T]); the returned mask drops tokens the correction rejects. Weights carry no gradient.
"""

from __future__ import annotations

import torch

from rolefleet.algos.functional import masked_mean
from rolefleet.algos.registry import Registry

IS_CORRECTIONS: Registry = Registry("importance-sampling correction")


def _log_w(old_logprobs, rollout_logprobs, mask):
    return ((old_logprobs - rollout_logprobs) * mask.to(old_logprobs.dtype)).detach()


@IS_CORRECTIONS.register("none")
def no_correction(old_logprobs, rollout_logprobs, mask, threshold: float):
    return torch.ones_like(old_logprobs), mask


@IS_CORRECTIONS.register("token_truncate")
def token_truncate(old_logprobs, rollout_logprobs, mask, threshold: float):
    w = torch.exp(_log_w(old_logprobs, rollout_logprobs, mask)).clamp(max=threshold)
    return w * mask.to(w.dtype), mask


@IS_CORRECTIONS.register("token_mask")
def token_mask(old_logprobs, rollout_logprobs, mask, threshold: float):
    w = torch.exp(_log_w(old_logprobs, rollout_logprobs, mask))
    keep = mask.bool() & (w <= threshold) & (w >= 1.0 / threshold)
    return w * keep.to(w.dtype), keep.to(mask.dtype)


@IS_CORRECTIONS.register("seq_truncate")
def seq_truncate(old_logprobs, rollout_logprobs, mask, threshold: float):
    log_w = _log_w(old_logprobs, rollout_logprobs, mask).sum(-1, keepdim=True)
    w = torch.exp(log_w.clamp(max=torch.log(torch.tensor(threshold, dtype=log_w.dtype))))
    return w * mask.to(w.dtype), mask


@IS_CORRECTIONS.register("seq_mask")
def seq_mask(old_logprobs, rollout_logprobs, mask, threshold: float):
    log_w = _log_w(old_logprobs, rollout_logprobs, mask).sum(-1, keepdim=True)
    bound = torch.log(torch.tensor(threshold, dtype=log_w.dtype))
    keep = mask.bool() & (log_w.abs() <= bound)
    return torch.exp(log_w) * keep.to(log_w.dtype), keep.to(mask.dtype)


def logprob_mismatch(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, max) of |logprobs - other| over the masked tokens: the train/rollout mismatch metric."""
    diff = (logprobs - other).abs() * mask.to(logprobs.dtype)
    return masked_mean(diff, mask), diff.max() if diff.numel() else diff.new_zeros(())

"""Importance-sampling correction between the rollout engine and the training engine.

Both engines hold the same weights but compute differently (kernels, precision, or an older policy
in async mode), so tokens were sampled from pi_rollout while the PPO ratio is taken against
pi_old recomputed by the trainer. Weights w = pi_old / pi_rollout correct for that; large weights
are truncated (w -> min(w, C)) or their tokens masked out, at token or sequence level
(sequence: w = prod over the response's tokens, one weight per response).

Each function: (old_logprobs, rollout_logprobs, mask [B, T], threshold C >= 1) -> (weights [B, T],
mask [B, T]); the returned mask drops tokens the correction rejects. Weights carry no gradient, are
0 on padding (except "none") and float32 for half-precision inputs.

Decisions are taken on log w, which is exact at any size; only the weight itself is exponentiated,
after clamping log w to +-MAX_LOG_WEIGHT: a rejected sequence's summed log-ratio easily passes 88,
where exp overflows float32, and inf * 0 would turn the whole loss into NaN.
"""

from __future__ import annotations

import math

import torch

from rolefleet.algos.functional import check_inputs, masked_mean, upcast
from rolefleet.algos.registry import Registry

IS_CORRECTIONS: Registry = Registry("importance-sampling correction")

# e^20 ~ 4.9e8: far beyond any useful threshold C, far below float32 overflow (e^88).
MAX_LOG_WEIGHT = 20.0


def _log_w(old_logprobs, rollout_logprobs, mask, threshold) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log w [B, T], 0 on padding and detached; bool mask [B, T])."""
    check_inputs(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if not threshold >= 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    m = mask.bool()
    diff = upcast(old_logprobs).detach() - upcast(rollout_logprobs).detach()
    return torch.where(m, diff, 0), m


def _weight(log_w: torch.Tensor, log_cap: float = MAX_LOG_WEIGHT) -> torch.Tensor:
    return torch.exp(log_w.clamp(-MAX_LOG_WEIGHT, min(log_cap, MAX_LOG_WEIGHT)))


def _drops_tokens(drops: bool):
    """Whether the correction's mask may drop tokens (`drops_tokens`): then the loss's divisor
    depends on every token's old logprob, so they must be known before an update's first forward."""
    def mark(fn):
        fn.drops_tokens = drops
        return fn

    return mark


@IS_CORRECTIONS.register("none")
@_drops_tokens(False)
def no_correction(old_logprobs, rollout_logprobs, mask, threshold: float):
    check_inputs(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    return torch.ones_like(upcast(old_logprobs)), mask


@IS_CORRECTIONS.register("token_truncate")
@_drops_tokens(False)
def token_truncate(old_logprobs, rollout_logprobs, mask, threshold: float):
    log_w, m = _log_w(old_logprobs, rollout_logprobs, mask, threshold)
    return torch.where(m, _weight(log_w, math.log(threshold)), 0), mask


@IS_CORRECTIONS.register("token_mask")
@_drops_tokens(True)
def token_mask(old_logprobs, rollout_logprobs, mask, threshold: float):
    log_w, m = _log_w(old_logprobs, rollout_logprobs, mask, threshold)
    bound = math.log(threshold)
    keep = m & (log_w.abs() <= bound)
    return torch.where(keep, _weight(log_w), 0), keep.to(mask.dtype)


@IS_CORRECTIONS.register("seq_truncate")
@_drops_tokens(False)
def seq_truncate(old_logprobs, rollout_logprobs, mask, threshold: float):
    log_w, m = _log_w(old_logprobs, rollout_logprobs, mask, threshold)
    seq_log_w = log_w.sum(-1, keepdim=True)
    return torch.where(m, _weight(seq_log_w, math.log(threshold)), 0), mask


@IS_CORRECTIONS.register("seq_mask")
@_drops_tokens(True)
def seq_mask(old_logprobs, rollout_logprobs, mask, threshold: float):
    log_w, m = _log_w(old_logprobs, rollout_logprobs, mask, threshold)
    seq_log_w = log_w.sum(-1, keepdim=True)
    keep = m & (seq_log_w.abs() <= math.log(threshold))
    return torch.where(keep, _weight(seq_log_w), 0), keep.to(mask.dtype)


def logprob_mismatch(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, max) of |logprobs - other| over the masked tokens, any shape: the train/rollout mismatch
    metric. Both are 0 when nothing is masked in."""
    check_inputs(None, logprobs=logprobs, other=other, mask=mask)
    m = mask.bool()
    # Cleaned before subtracting, so no non-finite value enters the graph at all (see functional.py).
    diff = (torch.where(m, upcast(logprobs), 0) - torch.where(m, upcast(other), 0)).abs()
    return masked_mean(diff, m), diff.max()

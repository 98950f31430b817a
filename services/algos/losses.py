"""Policy and value losses on right-padded [B, T] tensors with a 0/1 `mask`.

Each returns (scalar loss, stats as 0-dim tensors). The per-token loss is reduced by `agg` (see
rolefleet.algos.aggregation); `weights` (e.g. importance-sampling weights, no gradient) scale each
token's loss before aggregation.
"""

from __future__ import annotations

from typing import Optional

import torch

from rolefleet.algos.aggregation import aggregate
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
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
    agg: str = "token-mean",
    weights: Optional[torch.Tensor] = None,
    norm_length: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = pi / pi_old.

    clip_high > clip_low is the asymmetric "clip-higher" of DAPO (room for unlikely tokens to grow).
    dual_clip = c > 1 caps the loss of negative-advantage tokens at -A c (Ye et al. 2020), so a huge
    ratio on a bad token cannot dominate the batch.
    stats: pg_clipfrac (clipped branch taken), pg_clipfrac_lower (dual clip taken), ppo_kl.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach()}
    if dual_clip is not None:
        capped = torch.minimum(loss, -advantages * dual_clip)
        lower = (advantages < 0) & (loss > capped)
        loss = torch.where(advantages < 0, capped, loss)
        stats["pg_clipfrac_lower"] = masked_mean(lower.float(), mask).detach()
    if weights is not None:
        loss = loss * weights
    stats["ppo_kl"] = masked_mean(-log_ratio, mask).detach()
    return aggregate(loss, mask, agg, norm_length), stats


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: Optional[float] = None,
    agg: str = "seq-mean-token-mean",
    weights: Optional[torch.Tensor] = None,
    norm_length: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025), token form: one length-normalised sequence ratio
    s = exp(mean_t(log pi - log pi_old)) per response, clipped as in PPO (its clip range is small:
    the ratio is a geometric mean). The per-token ratio sg(s) * pi_t / sg(pi_t) equals s in value
    and passes each token's own gradient, so token-level advantages stay usable.
    dual_clip is not defined for GSPO and must be None.
    """
    if dual_clip is not None:
        raise ValueError("gspo does not take dual_clip")
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)                     # [B]
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if weights is not None:
        loss = loss * weights
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return aggregate(loss, mask, agg, norm_length), stats


@VALUE_LOSSES.register("clipped_mse")
def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2): the value may not move more than
    c from the value the advantages were computed with, unless that moves it closer to the return."""
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped_err, clipped_err), mask, agg)
    return loss, {"vf_clipfrac": masked_mean((clipped_err > unclipped_err).float(), mask).detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim. [..., V] -> [...]. Divide logits by the
    sampling temperature first to get the entropy of the sampling distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)

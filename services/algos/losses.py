"""Policy and value losses on right-padded [B, T] tensors with a 0/1 `mask`.

Each returns (scalar loss, stats as 0-dim tensors). The per-token loss is reduced by `agg` (see
rolefleet.algos.aggregation); `weights` (e.g. importance-sampling weights, no gradient) scale each
token's loss before aggregation. Masked positions of every input are replaced by 0 before any maths,
so padding holding inf or NaN changes neither the loss nor any gradient. Half-precision inputs are
computed in float32.
"""

from __future__ import annotations

from typing import Optional

import torch

from rolefleet.algos.aggregation import aggregate
from rolefleet.algos.functional import check_inputs, masked_mean, upcast
from rolefleet.algos.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")
VALUE_LOSSES: Registry = Registry("value loss")

# Bound of the per-token log-ratio log(pi / pi_old) before exp, as in verl: e^20 ~ 4.9e8 is far outside
# any clip range, while an unbounded ratio overflows float32 at e^89 (inf * 0 advantage = NaN). A token
# beyond the bound has a constant ratio and so no gradient, like a clipped token.
MAX_LOG_RATIO = 20.0
# Bound of GSPO's per-response log-ratio, the mean of the token log-ratios. verl caps it at 10 above;
# the matching lower bound keeps the two sides symmetric. Beyond it the response gets no gradient.
GSPO_MAX_SEQ_LOG_RATIO = 10.0


def _policy_inputs(logprobs, old_logprobs, advantages, mask, weights):
    """Checked, upcast inputs with 0 at masked positions, and the bool mask."""
    check_inputs(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask, weights=weights)
    m = mask.bool()

    def clean(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else torch.where(m, upcast(x), 0)

    return clean(logprobs), clean(old_logprobs), clean(advantages), m, clean(weights)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) [B, T], clipped branch taken [B, T])."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


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
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    logprobs, old_logprobs, advantages, m, weights = _policy_inputs(logprobs, old_logprobs, advantages, mask, weights)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    stats = {"pg_clipfrac": masked_mean(clipped.float(), m).detach()}
    if dual_clip is not None:
        capped = torch.minimum(loss, -advantages * dual_clip)
        lower = (advantages < 0) & (loss > capped)
        loss = torch.where(advantages < 0, capped, loss)
        stats["pg_clipfrac_lower"] = masked_mean(lower.float(), m).detach()
    if weights is not None:
        loss = loss * weights
    stats["ppo_kl"] = masked_mean(-log_ratio, m).detach()
    return aggregate(loss, m, agg, norm_length), stats


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
    logprobs, old_logprobs, advantages, m, weights = _policy_inputs(logprobs, old_logprobs, advantages, mask, weights)
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = masked_mean(log_ratio, m, dim=-1)                        # [B]
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    # Bounding the sum (not only the detached mean) also stops the token's gradient at the bound, as in verl.
    ratio = torch.exp(token_log_ratio.clamp(-GSPO_MAX_SEQ_LOG_RATIO, GSPO_MAX_SEQ_LOG_RATIO))
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    if weights is not None:
        loss = loss * weights
    stats = {
        "pg_clipfrac": masked_mean(clipped.float(), m).detach(),
        "ppo_kl": masked_mean(-log_ratio, m).detach(),
    }
    return aggregate(loss, m, agg, norm_length), stats


@POLICY_LOSSES.register("sft")
def sft_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
    dual_clip: Optional[float] = None,
    agg: str = "token-mean",
    weights: Optional[torch.Tensor] = None,
    norm_length: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning (`algorithm: sft`): the negative log-likelihood of the target tokens,
    -log pi(x_t), aggregated like any policy loss (token-mean: the mean over the batch's trained
    tokens). Old logprobs, advantages and the clip settings do not enter: the data's tokens are the
    targets, not samples to weigh. stats: nll (the token-mean NLL, whatever the aggregation)."""
    if dual_clip is not None:
        raise ValueError("sft does not take dual_clip")
    logprobs, _, _, m, weights = _policy_inputs(logprobs, old_logprobs, advantages, mask, weights)
    loss = -logprobs
    stats = {"nll": masked_mean(loss, m).detach()}
    if weights is not None:
        loss = loss * weights
    return aggregate(loss, m, agg, norm_length), stats


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
    c from the value the advantages were computed with, unless that moves it closer to the return.
    Any shape ([B, T], or packed [N] as one row) shared by all four tensors."""
    check_inputs(None, values=values, old_values=old_values, returns=returns, mask=mask)
    if not value_clip >= 0:
        raise ValueError(f"value_clip must be >= 0, got {value_clip}")
    m = mask.bool()
    values, old_values, returns = (torch.where(m, upcast(x), 0) for x in (values, old_values, returns))
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped_err, clipped_err), m, agg)
    return loss, {"vf_clipfrac": masked_mean((clipped_err > unclipped_err).float(), m).detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim. [..., V] -> [...]. Divide logits by the
    sampling temperature first to get the entropy of the sampling distribution. -inf logits (a masked
    vocabulary) are allowed; a row that is -inf everywhere has no distribution and gets 0."""
    if logits.dim() == 0:
        raise ValueError("logits must be [..., V], got a 0-dim tensor")
    if logits.numel() == 0:
        raise ValueError(f"logits is empty (shape {tuple(logits.shape)})")
    logits = upcast(logits)
    # A reduction, not a [..., V] comparison: this runs on every token's full vocabulary.
    alive = logits.amax(-1, keepdim=True) != -torch.inf
    logp = torch.log_softmax(torch.where(alive, logits, 0), dim=-1)
    p = logp.exp()
    # p log p -> 0 as p -> 0, but 0 * -inf is NaN (also in the backward): take 0 where p is 0.
    plogp = p * torch.where(p > 0, logp, 0)
    return torch.where(alive[..., 0], -plogp.sum(-1), 0)

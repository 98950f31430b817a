"""Loss aggregation, in one place: how a [B, T] per-token loss becomes one scalar.

token-mean             sum over all tokens / number of tokens (long responses weigh more)
seq-mean-token-mean    mean over tokens within each response, then mean over responses
seq-mean-token-sum     sum over tokens within each response, then mean over responses
seq-mean-token-sum-norm  sum over all tokens / (responses * norm_length): a constant normaliser per
                       response, so neither length nor batch composition rescales the gradient (Dr. GRPO)

"Responses" counts only rows with at least one token: a response the IS correction masked out
entirely is gone from the batch, not an extra zero that dilutes the others. An all-masked batch
gives 0 with a zero gradient. A 1-D loss [N] is one row. float32 for half-precision inputs.
"""

from __future__ import annotations

import torch

from rolefleet.algos.functional import check_inputs, masked_mean, masked_sum, upcast
from rolefleet.algos.registry import Registry

LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")


def _rows(loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [B, T] upcast, bool mask [B, T]) after checking the shapes."""
    check_inputs(None, loss=loss, mask=mask)
    if loss.dim() not in (1, 2):
        raise ValueError(f"loss must be [B, T] or [N], got shape {tuple(loss.shape)}")
    return upcast(loss).reshape(-1, loss.shape[-1]), mask.bool().reshape(-1, loss.shape[-1])


def _divides_by(unit: str):
    """Record what a mode divides by ("tokens" or "responses"), read by aggregation_weight."""
    def mark(fn):
        fn.divides_by = unit
        return fn
    return mark


@LOSS_AGGREGATIONS.register("token-mean")
@_divides_by("tokens")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    loss, m = _rows(loss, mask)
    return masked_mean(loss, m)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
@_divides_by("responses")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    loss, m = _rows(loss, mask)
    return masked_mean(masked_mean(loss, m, dim=-1), m.any(-1))


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
@_divides_by("responses")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    loss, m = _rows(loss, mask)
    return masked_sum(loss, m) / m.any(-1).sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
@_divides_by("responses")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    """norm_length: the constant divisor per sequence (e.g. max_new_tokens); default: padded width T."""
    if norm_length is not None and norm_length < 1:
        raise ValueError(f"norm_length must be >= 1, got {norm_length}")
    loss, m = _rows(loss, mask)
    length = norm_length if norm_length is not None else loss.shape[-1]
    return masked_sum(loss, m) / (m.any(-1).sum().clamp(min=1) * length)


def aggregation_weight(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `mode` divides by, up to its constant factor: tokens for token-mean, responses with at
    least one token for the seq-* modes. Every mode is additive over rows given its divisor, so a
    batch split into micro-batches gets the whole batch's loss as
    sum(aggregate(micro) x weight(micro) / weight(batch)). mask [B, T] -> 0-dim float32."""
    m = mask.bool().reshape(-1, mask.shape[-1])
    counted = m if LOSS_AGGREGATIONS.get(mode).divides_by == "tokens" else m.any(-1)
    return counted.sum().to(torch.float32)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] over `mask` with the named mode (see module docstring)."""
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, norm_length)

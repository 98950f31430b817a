"""Loss aggregation, in one place: how a [B, T] per-token loss becomes one scalar.

token-mean             sum over all tokens / number of tokens (long responses weigh more)
seq-mean-token-mean    mean over tokens within each response, then mean over responses
seq-mean-token-sum     sum over tokens within each response, then mean over responses
seq-mean-token-sum-norm  sum over all tokens / (B * norm_length): a constant normaliser, so neither
                       length nor batch composition rescales the gradient (Dr. GRPO)
"""

from __future__ import annotations

import torch

from rolefleet.algos.functional import masked_mean, masked_sum
from rolefleet.algos.registry import Registry

LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    return masked_mean(loss, mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    per_seq = masked_mean(loss, mask, dim=-1)
    has_tokens = mask.to(loss.dtype).sum(-1) > 0
    return masked_mean(per_seq, has_tokens)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    return masked_sum(loss, mask, dim=-1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm_length: int | None = None) -> torch.Tensor:
    """norm_length: the constant divisor per sequence (e.g. max_new_tokens); default: padded width T."""
    length = norm_length if norm_length is not None else loss.shape[-1]
    return masked_sum(loss, mask) / (loss.shape[0] * length)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] over `mask` with the named mode (see module docstring)."""
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, norm_length)

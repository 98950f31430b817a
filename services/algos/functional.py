"""Masked reductions shared by the estimators and losses."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over mask (all dims, or `dim`). An empty mask gives 0, not NaN."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked entries (0 when fewer than two)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = masked_mean(x, mask)
    return (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; padding positions come out as 0."""
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)

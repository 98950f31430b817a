"""Masked reductions and the input checks shared by the estimators and losses.

Masked positions are never read: every reduction selects with `torch.where`, so inf or NaN in
padding cannot reach a sum (`x * 0` would give NaN for x = inf). Functions that apply a non-linear
op (exp, square, rsqrt) first replace masked inputs by 0 with `where`, because `where` only zeroes the
gradient it passes back: the backward of exp(inf) would still multiply that 0 by inf.
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32 so sums over thousands of tokens do not lose precision (bf16 keeps
    8 mantissa bits: 256 + 1 == 256). float32 and float64 pass through unchanged."""
    return x.float() if x.dtype in _HALF else x


def check_inputs(ndim: int | None = 2, **named: torch.Tensor | None) -> None:
    """ValueError naming the first argument that is empty, has the wrong rank, or whose shape differs
    from the first argument's. None entries (optional inputs) are skipped. Shapes only: no sync."""
    ref_name, ref = None, None
    for name, x in named.items():
        if x is None:
            continue
        if ndim is not None and x.dim() != ndim:
            layout = "[B, T]" if ndim == 2 else f"{ndim}-D"
            raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
        if x.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): need at least one response and one token")
        if ref is None:
            ref_name, ref = name, x
        elif x.shape != ref.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def check_group_ids(group_ids: torch.Tensor, mask: torch.Tensor) -> None:
    if group_ids.shape != mask.shape[:1]:
        raise ValueError(f"group_ids must be [B] = ({mask.shape[0]},), got shape {tuple(group_ids.shape)}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over mask (all dims, or `dim`); masked entries are not read."""
    picked = torch.where(mask.bool(), x, 0)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over mask (all dims, or `dim`). An empty mask gives 0, not NaN."""
    m = mask.bool()
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked entries (0 when fewer than two)."""
    m = mask.bool()
    x = torch.where(m, x, 0)
    mean = masked_mean(x, m)
    return masked_sum((x - mean) ** 2, m) / (m.sum() - 1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries, any shape; padding positions come out as 0.
    An all-masked x gives all zeros."""
    check_inputs(None, x=x, mask=mask)
    m = mask.bool()
    x = torch.where(m, upcast(x), 0)
    mean = masked_mean(x, m)
    out = (x - mean) * torch.rsqrt(masked_var(x, m) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0)

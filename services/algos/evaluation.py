"""Evaluation maths: pass@k from k of n samples per prompt.

pass@k is the chance that at least one of k samples, drawn without replacement from a prompt's n,
is correct: 1 - C(n - c, k) / C(n, k) for a prompt with c correct samples (the unbiased estimator
of Chen et al., 2021), averaged over prompts. Computed as a product, 1 - prod_{i=n-c+1..n}(1 - k/i),
so no binomial coefficient overflows at large n.
"""

from __future__ import annotations

import torch


def pass_at_k(correct: torch.Tensor, k: int) -> torch.Tensor:
    """correct: bool [P, n] (prompt p's n samples) -> float64 scalar tensor, the mean over prompts
    of each prompt's pass@k. Needs 1 <= k <= n."""
    if correct.dim() != 2 or correct.shape[0] == 0:
        raise ValueError(f"correct must be [prompts, samples] with prompts > 0, got {tuple(correct.shape)}")
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for {n} samples per prompt, got {k}")
    wrong = n - correct.sum(dim=1, dtype=torch.int64)                   # [P]
    i = torch.arange(1, n + 1, dtype=torch.float64)                     # [n]
    # Factor (1 - k / i) for i in (wrong, n]: all k drawn among the wrong ones. When wrong < k the
    # product has a zero factor (i = k) and pass@k is 1.
    factors = torch.where(i[None, :] > wrong[:, None].double(), 1.0 - k / i[None, :], torch.ones_like(i)[None, :])
    return (1.0 - factors.prod(dim=1)).mean()

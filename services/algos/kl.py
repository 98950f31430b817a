"""Per-token estimators of KL(policy || reference) from logprobs of the sampled tokens.

k1 = log r, k2 = (log r)^2 / 2, k3 = r^-1 - 1 + log r with r = pi/pi_ref (Schulman's low-variance
estimator in the "exp(-log r) - 1 + log r" form). Inputs [B, T] or [N]; output the same shape.
"""

from __future__ import annotations

import torch
from rolefleet.algos.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - 1 - log_ratio

"""KL to the reference policy: per-token estimators and the penalty-coefficient controllers.

Estimators take logprobs of the sampled tokens under the policy and the reference, any shape:
k1 = log r, k2 = (log r)^2 / 2, k3 = r^-1 - 1 + log r with r = pi / pi_ref (k3: Schulman's
low-variance, always >= 0 estimator). Used as a reward penalty (coordinator) or a loss term (actor).
"""

from __future__ import annotations

import math

import torch

from rolefleet.algos.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
KL_CONTROLLERS: Registry = Registry("KL controller")


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


@KL_CONTROLLERS.register("fixed")
def fixed_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    return coef


@KL_CONTROLLERS.register("adaptive")
def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Proportional controller (Ziegler et al. 2019): move the coefficient so the observed KL tracks
    `target`; the error is clipped to +-20% so one noisy step cannot swing it."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    new = coef * (1.0 + error * n_steps / horizon)
    return new if math.isfinite(new) else coef

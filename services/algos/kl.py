"""KL to the reference policy: per-token estimators and the penalty-coefficient controllers.

Estimators take logprobs of the sampled tokens under the policy and the reference, any shape (same
for both), and work elementwise, so padding only affects its own positions; callers aggregate over a
mask. k1 = log r, k2 = (log r)^2 / 2, k3 = r^-1 - 1 + log r with r = pi / pi_ref (k3: Schulman's
low-variance, always >= 0 estimator). Used as a reward penalty (coordinator) or a loss term (actor).
float32 for half-precision inputs.
"""

from __future__ import annotations

import math

import torch

from rolefleet.algos.functional import check_inputs, upcast
from rolefleet.algos.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
KL_CONTROLLERS: Registry = Registry("KL controller")

# k3 exponentiates log(pi_ref / pi), which overflows float32 past 88 (and inf x 0 is NaN in the backward
# of a masked token); well before that one token's k3 (e^12 - 13 = 1.6e5 at a log-ratio of 12) would
# swamp the batch. Same bounds as verl's low_var_kl: the log-ratio to +-20, k3 itself to +-10. Outside
# either bound the token's k3 is a constant with zero gradient.
K3_MAX_LOG_RATIO = 20.0
K3_MAX = 10.0
# Largest relative move of the adaptive coefficient in one update (Ziegler et al. clip the error here).
ADAPTIVE_MAX_ERROR = 0.2


def _pair(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(None, logprobs=logprobs, ref_logprobs=ref_logprobs)
    return upcast(logprobs), upcast(ref_logprobs)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    logprobs, ref_logprobs = _pair(logprobs, ref_logprobs)
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    logprobs, ref_logprobs = _pair(logprobs, ref_logprobs)
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    logprobs, ref_logprobs = _pair(logprobs, ref_logprobs)
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
    return (torch.exp(log_ratio) - 1 - log_ratio).clamp(-K3_MAX, K3_MAX)


def _check_controller(coef: float, target: float, horizon: int, n_steps: int) -> None:
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target}")
    if not horizon > 0:
        raise ValueError(f"horizon must be > 0, got {horizon}")
    if not n_steps >= 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps}")


@KL_CONTROLLERS.register("fixed")
def fixed_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    _check_controller(coef, target, horizon, n_steps)
    return coef


@KL_CONTROLLERS.register("adaptive")
def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Proportional controller (Ziegler et al. 2019): move the coefficient so the observed KL tracks
    `target`; the error is clipped to +-20% so one noisy step cannot swing it. Ziegler's multiplier
    1 + error * n_steps / horizon turns negative once n_steps > 5 * horizon; here n_steps counts up to
    one horizon, so the multiplier stays in [0.8, 1.2] and the coefficient positive. A non-finite KL
    (a diverged step) leaves the coefficient unchanged."""
    _check_controller(coef, target, horizon, n_steps)
    if not math.isfinite(current_kl):
        return coef
    error = min(max(current_kl / target - 1.0, -ADAPTIVE_MAX_ERROR), ADAPTIVE_MAX_ERROR)
    new = coef * (1.0 + error * min(n_steps / horizon, 1.0))
    return new if math.isfinite(new) else coef


# --- KL to a teacher over its most likely tokens (on-policy distillation's loss term) -----------------

TEACHER_KL: Registry = Registry("teacher KL")
# The tail's probability is kept at least this: the student's top-k may hold all its mass in float32,
# and log(0) would make the tail term's gradient infinite.
MIN_TAIL = 1e-6


def _with_tail(top: torch.Tensor) -> torch.Tensor:
    """[..., k] logprobs of k tokens -> [..., k + 1]: the k, then the log-probability of every other
    token together (the tail, at least `MIN_TAIL`)."""
    top = upcast(top)
    mass = torch.logsumexp(top, dim=-1, keepdim=True).clamp(max=math.log1p(-MIN_TAIL))
    return torch.cat([top, torch.log(-torch.expm1(mass))], dim=-1)


def _teacher_pair(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(None, teacher_logprobs=teacher_logprobs, student_logprobs=student_logprobs)
    if teacher_logprobs.dim() < 1 or teacher_logprobs.shape[-1] < 1:
        raise ValueError(f"teacher_logprobs must end in a top-k dimension, got shape {tuple(teacher_logprobs.shape)}")
    return _with_tail(teacher_logprobs), _with_tail(student_logprobs)


def _expected(logp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum(p * x) over the last dimension; an outcome of probability 0 adds 0 (not 0 x inf)."""
    p = logp.exp()
    return torch.where(p > 0, p * x, 0).sum(-1)


@TEACHER_KL.register("forward")
def teacher_kl_forward(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, [..., k] -> [...]: the teacher's k most likely tokens
    (`teacher_logprobs`, log pi_T of each) and the student's logprobs of the same tokens, over k + 1
    outcomes: the k tokens and the rest of the vocabulary as one (the tail). Exact for the two
    distributions coarsened to those outcomes, >= 0, and 0 only where the student gives each of the
    k tokens the teacher's probability (and so the tail too); with k the vocabulary, the full KL.
    Mode-covering: the student is pulled up on every token the teacher finds likely."""
    t, s = _teacher_pair(teacher_logprobs, student_logprobs)
    return _expected(t, t - s)


@TEACHER_KL.register("reverse")
def teacher_kl_reverse(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) per position over the same k + 1 outcomes as `forward`: mode-seeking
    (the student is pushed down where the teacher is not, but its tail is one outcome)."""
    t, s = _teacher_pair(teacher_logprobs, student_logprobs)
    return _expected(s, s - t)

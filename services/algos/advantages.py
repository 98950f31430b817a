"""Advantage estimators. Inputs are right-padded [B, T] per-token tensors with a 0/1 `mask`; outcome
estimators read each response's score as the sum of its token rewards (the score sits on the last
token, plus any per-token KL penalty). Returns (advantages [B, T], returns [B, T]), 0 on padding;
float32 for half-precision inputs, the input dtype otherwise.

group_ids [B] (int64) mark responses to the same prompt (GRPO, RLOO, REINFORCE++-baseline). A response
with no tokens takes no part in its group's statistics and gets advantage 0.

Each estimator declares the inputs it needs as parameters; the coordinator calls it through
`ADVANTAGE_ESTIMATORS.call`, so a new estimator needs nothing but its registered function.
"""

from __future__ import annotations

import torch

from rolefleet.algos.functional import check_group_ids, check_inputs, masked_sum, masked_whiten, upcast
from rolefleet.algos.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


def _clean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, upcast(x), 0)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k within each response. [B, T] -> [B, T], 0 on padding."""
    check_inputs(token_rewards=token_rewards, mask=mask)
    m = mask.bool()
    rewards = _clean(token_rewards, m)
    running = torch.zeros_like(rewards[:, 0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, 0)
        columns.append(running)
    return torch.stack(columns[::-1], dim=1)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor,
                 valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response (group sum, group size, unbiased group std) of `scores` [B] over the `valid`
    responses [B] of each group."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = scores.new_zeros(uniq.numel())
    size = zeros.index_add(0, inverse, valid.to(scores.dtype))
    total = zeros.index_add(0, inverse, torch.where(valid, scores, 0))
    mean = total / size.clamp(min=1)
    sq = zeros.index_add(0, inverse, torch.where(valid, (scores - mean[inverse]) ** 2, 0))
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    return total[inverse], size[inverse], std[inverse]


def _outcome_inputs(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor):
    """(bool mask [B, T], scores [B], has-tokens [B]) after checking the shapes."""
    check_inputs(token_rewards=token_rewards, mask=mask)
    check_group_ids(group_ids, mask)
    m = mask.bool()
    return m, masked_sum(upcast(token_rewards), m, dim=-1), m.any(-1)


def _broadcast(per_seq: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, per_seq[:, None], 0)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation with a critic. After the last masked token the value is 0
    (terminal). returns = advantages + values."""
    check_inputs(token_rewards=token_rewards, values=values, mask=mask)
    m = mask.bool()
    values, rewards = _clean(values, m), _clean(token_rewards, m)
    last = torch.zeros_like(values[:, 0])
    columns = []
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Padding holds no state: the running sum is reset there so it cannot leak into real tokens.
        last = torch.where(m[:, t], delta + gamma * lam * last, 0)
        columns.append(last)
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, torch.where(m, advantages + values, 0)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised outcome advantage: (score - group mean) / (group std + eps), the same for every
    token of a response. norm_by_std=False gives the Dr. GRPO advantage (no std scaling), which does
    not up-weight prompts whose answers barely differ."""
    m, scores, valid = _outcome_inputs(token_rewards, mask, group_ids)
    total, size, std = _group_stats(scores, group_ids, valid)
    adv = scores - total / size.clamp(min=1)
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, m)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: score minus the mean score of the *other* responses to the prompt.
    A response alone in its group has no baseline and gets advantage 0."""
    m, scores, valid = _outcome_inputs(token_rewards, mask, group_ids)
    total, size, _ = _group_stats(scores, group_ids, valid)
    baseline = (total - scores) / (size - 1).clamp(min=1)
    adv = torch.where(valid & (size > 1), scores - baseline, 0)
    adv = _broadcast(adv, m)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: per-token discounted returns (token-level KL penalty included) whitened over the
    whole batch instead of a critic or group baseline. Returns (whitened, raw returns)."""
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(token_rewards: torch.Tensor, mask: torch.Tensor,
                          group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline: score minus the group mean, broadcast to tokens, then whitened over
    the batch (the batch std, not each group's, so easy prompts are not up-weighted)."""
    m, scores, valid = _outcome_inputs(token_rewards, mask, group_ids)
    total, size, _ = _group_stats(scores, group_ids, valid)
    centred = _broadcast(scores - total / size.clamp(min=1), m)
    return masked_whiten(centred, m), centred


@ADVANTAGE_ESTIMATORS.register("distill")
def distill(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each token the student sampled is credited with
    log pi_teacher(x_t) - log pi_student(x_t), minus the per-token estimate (k1) of the reverse KL
    KL(student || teacher) on the student's own samples, and with nothing of the tokens after it (no
    discount, no baseline: the teacher grades every token, so none is needed). A policy-gradient step
    on it lowers the reverse KL: the student moves toward the teacher where it samples. Also the term
    `train.distill_coef` adds to another estimator's advantages (the mixed form)."""
    check_inputs(logprobs=logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    m = mask.bool()
    adv = torch.where(m, upcast(teacher_logprobs) - upcast(logprobs), 0)
    return adv, adv

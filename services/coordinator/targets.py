"""Step targets: token rewards (score on the last token minus the KL penalty), then the algorithm's
advantage estimator. Batches stay packed; tensors are padded only around the pure functions."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rolefleet.actor.types import ActorUpdateResult, FinishReason, LogProbs, Sample
from rolefleet.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, OVERLONG
from rolefleet.algos.functional import masked_whiten
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import TrainSection
from rolefleet.common.errors import FailedPrecondition


@dataclass(frozen=True)
class Targets:
    advantages: torch.Tensor  # float32 [N]
    returns: torch.Tensor     # float32 [N]
    kl: torch.Tensor          # float32 [N], per-token KL estimate to the reference


def truncated(samples: list[Sample]) -> torch.Tensor:
    """bool [B]: the responses cut at the length cap."""
    return torch.tensor([smp.finish_reason == FinishReason.LENGTH for smp in samples], dtype=torch.bool)


def shaped_scores(train: TrainSection, max_new_tokens: int, batch: SequenceBatch, scores: torch.Tensor,
                  truncated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """`train.overlong` on a batch (`truncated` [B] bool: the responses cut at the cap): the scores
    the advantages are computed from, which samples the policy's update trains on ([B] bool), and
    the record's `overlong/*` entries."""
    o = train.overlong
    shaped, keep = OVERLONG.call(o.mode, scores=scores, lengths=batch.response_lengths, truncated=truncated,
                                 max_len=max_new_tokens, buffer=o.buffer_tokens, factor=o.penalty_factor)
    if o.mode == "none":
        return shaped, keep, {}
    delta = shaped - scores
    return shaped, keep, {"overlong/shaping_mean": delta.mean().item(),
                          "overlong/shaped_fraction": (delta != 0).float().mean().item(),
                          "overlong/filtered_fraction": (~keep).float().mean().item()}


def step_targets(estimator: str, batch: SequenceBatch, scores: torch.Tensor, values: torch.Tensor,
                 logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor, group_ids: torch.Tensor, kl_coef: float,
                 train: TrainSection, teacher: torch.Tensor | None = None,
                 rollout_logprobs: torch.Tensor | None = None) -> Targets:
    """scores [B]; values, logprobs, ref_logprobs packed [N]; group_ids [B]. Without the policy's
    logprobs (a one-pass update computes them; `RoleFleetConfig.one_pass_update` asks for no KL
    penalty) the KL is 0 until `after_one_pass` fills it in. `teacher`: the teacher's logprobs of
    the sampled tokens (packed [N]; on-policy distillation), graded against the student's: the
    policy's recomputed ones where there are, else `rollout_logprobs` (what the engine sampled with)."""
    kl = torch.zeros_like(ref_logprobs) if logprobs is None else kl_to_reference(train, logprobs, ref_logprobs)
    if batch.loss_mask is not None:
        kl = kl * batch.loss_mask  # an observation token is no action of the policy: no KL, no reward
    token_rewards = batch.pad_responses(-kl_coef * kl)
    token_rewards[torch.arange(len(batch)), batch.response_lengths - 1] += scores
    # The estimators see each response's own tokens side by side: in a multi-turn response the
    # model's turns are one trajectory, the observations between them are no steps of it (GAE
    # bootstraps a turn's last token from the next turn's first value, not from an observation).
    mask = batch.train_mask()
    order = _own_first(mask) if batch.loss_mask is not None else None  # single-turn: nothing to move

    def gathered(x: torch.Tensor) -> torch.Tensor:
        return x if order is None else x.gather(1, order)

    own = gathered(mask)
    distilling = {}
    if teacher is not None:
        student = logprobs if logprobs is not None else rollout_logprobs
        distilling = {"logprobs": gathered(batch.pad_responses(student)),
                      "teacher_logprobs": gathered(batch.pad_responses(teacher))}
    # Each estimator takes the inputs its signature declares from these.
    advantages, returns = ADVANTAGE_ESTIMATORS.call(
        estimator, token_rewards=gathered(token_rewards), values=gathered(batch.pad_responses(values)), mask=own,
        group_ids=group_ids, gamma=train.gamma, lam=train.lam, norm_by_std=train.norm_adv_by_std, **distilling,
    )
    if train.whiten_advantages:
        advantages = masked_whiten(advantages, own)
    if train.distill_coef and distilling:
        # The mixed form: the teacher's grade of each token beside the algorithm's own advantage
        # (after its normalisation, so that distill_coef weighs it against advantages of unit scale).
        advantages = advantages + train.distill_coef * ADVANTAGE_ESTIMATORS.call("distill", mask=own, **distilling)[0]
    if order is not None:
        advantages, returns = (torch.zeros_like(x).scatter(1, order, torch.where(own, x, 0))
                               for x in (advantages, returns))
    return Targets(batch.pack_responses(advantages), batch.pack_responses(returns), kl)


def _own_first(mask: torch.Tensor) -> torch.Tensor:
    """int64 [B, T]: per row, the columns of its True entries in order, then the others (a stable
    sort on "not own" keeps each group in column order)."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


def after_one_pass(train: TrainSection, logprobs: LogProbs, targets: Targets,
                   actor: ActorUpdateResult) -> tuple[LogProbs, Targets]:
    """A one-pass update's step: the policy's logprobs and entropy that its forward computed (before
    its optimizer step) beside the reference's, and the KL metric from them."""
    if actor.logprobs is None:
        raise FailedPrecondition(f"the actor's one-pass update of step {actor.step} returned no logprobs")
    full = replace(logprobs, logprobs=actor.logprobs.logprobs, entropy=actor.logprobs.entropy)
    return full, replace(targets, kl=kl_to_reference(train, full.logprobs, full.ref_logprobs))


def kl_to_reference(train: TrainSection, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate (`train.kl_estimator`) of the policy to the reference, packed [N]."""
    return KL_ESTIMATORS.get(train.kl_estimator)(logprobs, ref_logprobs)

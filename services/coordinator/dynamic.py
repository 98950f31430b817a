"""DAPO's dynamic sampling (`train.dynamic_sampling`; docs/algorithms.md, "The long tail"): the
filter over a step's scored groups that sync mode's `DynamicSampling`, the async pipeline's train
stage and partial rollouts share."""

from __future__ import annotations

import dataclasses

import torch

from rolefleet.algos import informative_groups
from rolefleet.common.config import RoleFleetConfig
from rolefleet.coordinator.episodes import with_env_rewards
from rolefleet.coordinator.rollout import Rollout, to_batch
from rolefleet.coordinator.saved_state import PipelineCounts
from rolefleet.coordinator.targets import shaped_scores, truncated
from rolefleet.reward.types import ScoreResult


class KeptGroups:
    """DAPO's dynamic sampling over the batches of one step, in either mode: each scored batch's
    groups whose samples all score the same (after `train.overlong` shaping and the environment's
    rewards: what the advantages see) are dropped, the others kept up to `prompts_per_step`, until
    the step has them all or `train.dynamic_sampling.max_batches` batches were drawn (`done`; partial
    rollouts decide when to stop themselves). The step then trains on the groups it kept (fewer
    when the bound was reached; all of the last scored batch if none had a signal, so the step still
    applies its KL and entropy terms)."""

    def __init__(self, cfg: RoleFleetConfig, trim: bool = True):
        """`trim`: informative groups past `prompts_per_step` are dropped too (partial rollouts keep
        them: a group that finished cannot wait for a later step)."""
        self.cfg, self.need, self.trim = cfg, cfg.train.prompts_per_step, trim
        self.kept: list[tuple[Rollout, ScoreResult, list[int]]] = []  # (batch, its scores, its kept prompts)
        self.groups = self.dropped = self.batches = 0
        self.generate_s = self.score_s = 0.0

    @property
    def done(self) -> bool:
        return self.groups >= self.need or self.batches >= self.cfg.train.dynamic_sampling.max_batches

    def add(self, batch: Rollout, scores: ScoreResult, score_s: float, drawn: bool = True) -> None:
        """A scored batch's groups; `drawn`: it is a batch of the data (counted towards `max_batches`),
        not the groups of several that finished together (partial rollouts count their own)."""
        self.batches += drawn
        self.generate_s, self.score_s = self.generate_s + batch.generate_s, self.score_s + score_s
        total = with_env_rewards(scores, batch.samples).total
        shaped, _, _ = shaped_scores(self.cfg.train, self.cfg.episode_cap, batch.batch, total,
                                     truncated(batch.samples))
        signal = informative_groups(shaped, torch.tensor([s.group_id for s in batch.samples]),
                                    self.cfg.train.dynamic_sampling.tolerance)
        prompts = sorted({s.prompt_index for s, ok in zip(batch.samples, signal.tolist()) if ok})
        self.dropped += len(batch.records) - len(prompts)
        self.kept.append((batch, scores, prompts[: self.need - self.groups] if self.trim else prompts))
        self.groups += len(self.kept[-1][2])

    def rollout(self, step: int, counts: PipelineCounts) -> Rollout:
        """The step's rollout of the kept groups; their drops counted (the refills are the caller's)."""
        counts.dropped_groups += self.dropped
        kept = self.kept
        if self.groups == 0:  # no batch had a signal: the last one whole
            batch, scores, _ = kept[-1]
            kept = [(batch, scores, list(range(len(batch.records))))]
        rollout = joined(step, kept, self.generate_s, self.score_s)
        rollout.stats = {"dynamic/kept_groups": float(self.groups), "dynamic/dropped_groups": float(self.dropped),
                         "dynamic/batches": float(self.batches),
                         "dynamic/dropped_groups_total": float(counts.dropped_groups)}
        return rollout


def joined(step: int, parts: list[tuple[Rollout, ScoreResult, list[int]]], generate_s: float,
            score_s: float) -> Rollout:
    """One rollout of the chosen prompts of several batches, with their samples (renumbered to the
    joined prompt list; group and sample ids stay the run's) and their scores. Critic values and
    reference logprobs that came with a batch (async mode) are left behind: the step body asks for
    those of the joined batch."""
    records, samples, rows = [], [], []
    for batch, scores, prompts in parts:
        position = {p: len(records) + i for i, p in enumerate(prompts)}
        records += [batch.records[p] for p in prompts]
        chosen = [i for i, s in enumerate(batch.samples) if s.prompt_index in position]
        samples += [dataclasses.replace(batch.samples[i], prompt_index=position[batch.samples[i].prompt_index])
                    for i in chosen]
        rows.append(scores.select(chosen))
    return Rollout(step, records, samples, to_batch(samples), generate_s, reward=ScoreResult.concat(rows),
                   score_s=score_s, env_s=sum(batch.env_s for batch, _, _ in parts))

"""Partial rollouts (`pipeline.partial_rollouts`; docs/algorithms.md, "The long tail"): sync mode's
step 1 without the long tail.

A batch takes as long as its longest responses, while most of them end early. Here a step generates
at most `token_budget` tokens of each response:

1. the responses carried from earlier steps are generated on (actor.Generate with continuations
   that resume them: nothing is appended and nothing is tokenized again), and the data's next batch
   is started, all within the budget;
2. a response that ended (its stop token, or `sampling.max_new_tokens` in all) is finished; one cut
   at the budget is carried into the next step, where the policy of that step generates on;
3. the step trains on every group whose responses have all finished (GRPO's statistics need the
   whole group). If none has, the open responses are generated on again, with the same policy,
   until one group finishes. With `train.dynamic_sampling`, the groups are scored as they finish,
   those whose samples all score the same are dropped (`dynamic.KeptGroups`), and every
   `prompts_per_step` groups dropped bring the data's next batch into a step (`_next`).

A carried response's tokens keep the rollout logprobs and the policy version that made them
(`Sample.token_versions`): the update's importance-sampling correction weighs each token by
pi_train / pi_that_made_it, and the sample's `policy_version` is its first token's, so the
staleness bound (`pipeline.max_staleness`, which the actor checks) counts from it. A response
begun at step j generates to its end at step j + `max_staleness` at the latest: no sample ever
exceeds the bound and none is dropped. Each step draws one batch of the data (with dynamic
sampling, up to `max_batches`); every group is trained once (or dropped by dynamic sampling), at
most `max_staleness` steps after it began. The carried responses are part of the coordinator's
checkpoint (`CoordinatorState.carried`): a resumed run generates on from where the saved one was.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from rolefleet.actor.client import ActorClient
from rolefleet.actor.rollout import derived_seed
from rolefleet.actor.types import SAMPLES_PER_GROUP_LIMIT, Continuation, FinishReason, Sample, SamplingParams
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.dynamic import KeptGroups
from rolefleet.coordinator.rollout import Rollout, first_group_id, sampling_for, score_items, spent, to_batch
from rolefleet.coordinator.saved_state import CarriedGroup, CarriedResponse, CoordinatorState
from rolefleet.reward.client import RewardClient
from rolefleet.tasks import PromptRecord


@dataclass
class _Response:
    """One sample's response so far: `sample` holds its ids, logprobs and text whole (its
    `prompt_ids` the prompt's); `versions` the policy version of each of its tokens."""

    sample: Sample
    versions: torch.Tensor  # int64 [R]
    carries: int = 0        # steps it has been carried into
    full: bool = False      # the model's positions are full: the actor answered no tokens

    def finished(self, cap: int) -> bool:
        return self.full or self.sample.finish_reason == FinishReason.STOP or len(self.sample.response_ids) >= cap

    def extended(self, piece: Sample) -> _Response:
        """With the tokens `piece` generated on it (its text is the whole response's: the actor
        decodes a resumed response in one piece)."""
        s = self.sample
        return replace(self, full=not len(piece.response_ids), sample=replace(s, response_ids=torch.cat([s.response_ids, piece.response_ids]),
                                            logprobs=torch.cat([s.logprobs, piece.logprobs]),
                                            finish_reason=piece.finish_reason, response_text=piece.response_text),
                       versions=torch.cat([self.versions, torch.full((len(piece.response_ids),), piece.policy_version)]))

    def trained(self, prompt_index: int) -> Sample:
        """The sample the step trains on: the version of its oldest token is its policy version."""
        return replace(self.sample, prompt_index=prompt_index, policy_version=int(self.versions.min()),
                       token_versions=self.versions)


@dataclass
class _Group:
    batch: int              # the data batch it came from (1-based)
    prompt: int             # its prompt's place in that batch
    record: PromptRecord
    responses: list[_Response]

    def finished(self, cap: int) -> bool:
        return all(r.finished(cap) for r in self.responses)


class PartialRollouts:
    """Sync mode's step 1 with `pipeline.partial_rollouts` (module docstring)."""

    def __init__(self, cfg: RoleFleetConfig, actor: ActorClient, dataset: PromptDataset,
                 reward: RewardClient | None = None):
        """`reward`: with `train.dynamic_sampling`, what scores the groups as they finish."""
        self.cfg, self.actor, self.dataset, self.reward = cfg, actor, dataset, reward
        self.budget, self.cap = cfg.pipeline.partial_rollouts.token_budget, cfg.sampling.max_new_tokens
        self.max_carries = cfg.pipeline.max_staleness
        self.carried: list[_Group] | None = None  # read from the state at the first step (a resumed run's)

    async def rollout(self, step: int, state: CoordinatorState) -> Rollout:
        if self.carried is None:
            self.carried = [self._group_from_saved(g) for g in state.carried]
        start, index = time.perf_counter(), state.batches_used + 1
        sampling = sampling_for(self.cfg, index)
        kept = KeptGroups(self.cfg, trim=False) if self.reward is not None else None
        groups, version = await self._begin(index, self.carried, sampling, 0)
        batches = rounds = 1
        scored: set[int] = set()  # the groups already scored (dynamic sampling)
        while True:
            finished = [g for g in groups if g.finished(self.cap)]
            if kept is not None and (new := [g for g in finished if id(g) not in scored]):
                scored.update(map(id, new))
                await self._score(step, new, kept)
            next_step = self._next(groups, finished, kept, batches, state)
            if next_step == "train":
                break
            if next_step == "refill":  # the data's next batch joins the step
                groups = (await self._begin(index + batches, groups, sampling, rounds))[0]
                batches += 1
            else:  # nothing to train on yet: on with this policy
                await self._generate_on(groups, sampling, rounds)
            rounds += 1
        done = [g for g in groups if g.finished(self.cap)]
        self.carried = [g for g in groups if not g.finished(self.cap)]
        for g in self.carried:
            g.responses = [replace(r, carries=r.carries + (not r.finished(self.cap))) for r in g.responses]
        state.carried = [self._group_to_saved(g) for g in self.carried]
        generate_s = spent("generate", start + (kept.score_s if kept else 0.0))  # scoring is its own phase
        open_responses = sum(not r.finished(self.cap) for g in self.carried for r in g.responses)
        if kept is None:
            samples = [r.trained(i) for i, g in enumerate(done) for r in g.responses]
            rollout = Rollout(step, [g.record for g in done], samples, to_batch(samples), generate_s)
        else:
            state.counts.refill_batches += batches - 1
            kept.batches = batches  # the data batches drawn (the filter saw groups as they finished)
            rollout = kept.rollout(step, state.counts)
            rollout.generate_s = generate_s
        rollout.stats.update(_stats(rollout.samples, version, len(rollout.records), len(self.carried),
                                    open_responses, rounds))
        return rollout

    async def _begin(self, index: int, groups: list[_Group], sampling: SamplingParams,
                     round_: int) -> tuple[list[_Group], int]:
        """Data batch `index` started and the open responses of `groups` generated on, each by the
        budget (`sampling`: the step's): the groups, then the new ones; the policy version."""
        records = self.dataset.batch(index, self.cfg.train.prompts_per_step)
        fresh, _ = await asyncio.gather(
            self.actor.generate([r.prompt for r in records],
                                replace(sampling_for(self.cfg, index), max_new_tokens=self.budget),
                                first_group_id(self.cfg, index)),
            self._generate_on(groups, sampling, round_))
        return [*groups, *_new_groups(index, records, fresh)], max(s.policy_version for s in fresh)

    def _next(self, groups: list[_Group], finished: list[_Group], kept: KeptGroups | None, batches: int,
              state: CoordinatorState) -> str:
        """What the step does next: "train" on what finished, "refill" (dynamic sampling: the data's
        next batch joins the step) or "generate" on the open responses.

        Without dynamic sampling a step trains once a group finished. With it, a group needs a
        signal, and dropped groups are replaced: every `prompts_per_step` groups dropped in the run
        bring in one more batch (the remainder counts towards a later step's), at most `max_batches`
        a step, so the groups trained per step stay near `prompts_per_step`. Groups still open are
        not replaced: they train in a later step. Past `max_batches`, or with nothing open and
        nothing kept, the step trains the last groups it scored."""
        if kept is None:
            return "train" if finished else "generate"
        room = batches < self.cfg.train.dynamic_sampling.max_batches
        owed = (state.counts.dropped_groups + kept.dropped) // kept.need - (state.counts.refill_batches + batches - 1)
        if room and owed > 0:
            return "refill"
        if kept.groups:
            return "train"
        if any(not g.finished(self.cap) for g in groups):
            return "generate"
        return "refill" if room else "train"

    async def _score(self, step: int, groups: list[_Group], kept: KeptGroups) -> None:
        """Dynamic sampling: the scores of groups that just finished, kept or dropped by `kept`."""
        records = [g.record for g in groups]
        samples = [r.trained(i) for i, g in enumerate(groups) for r in g.responses]
        start = time.perf_counter()
        scores = await self.reward.score(score_items(records, samples))
        kept.add(Rollout(step, records, samples, to_batch(samples), 0.0), scores, spent("score", start), drawn=False)

    async def _generate_on(self, groups: list[_Group], sampling: SamplingParams, round_: int) -> None:
        """The groups' open responses generated on, each by the budget or (carried `max_carries`
        times) to its end: one request per token count."""
        responses = [r for g in groups for r in g.responses if not r.finished(self.cap)]
        pieces = await self._pieces(responses, sampling, round_)
        extended = {id(r): r.extended(p) for r, p in zip(responses, pieces)}
        for g in groups:
            g.responses = [extended.get(id(r), r) for r in g.responses]

    async def _pieces(self, responses: list[_Response], sampling: SamplingParams, round_: int) -> list[Sample]:
        """What the actor generates on each response, in the order of `responses`."""
        if not responses:
            return []
        by_tokens: dict[int, list[int]] = {}
        for i, r in enumerate(responses):
            left = self.cap - len(r.sample.response_ids)
            by_tokens.setdefault(left if r.carries >= self.max_carries else min(self.budget, left), []).append(i)
        seeded = replace(sampling, n=1, seed=derived_seed(sampling.seed, 1 + round_))
        requests = [(tokens, part) for tokens, rows in by_tokens.items()
                    for part in self._within_limits(rows, responses, tokens)]
        answers = await asyncio.gather(*(self.actor.generate(
            [], replace(seeded, max_new_tokens=tokens, seed=derived_seed(derived_seed(seeded.seed, part[0]), tokens)), 0,
            [_resume(responses[i].sample) for i in part]) for tokens, part in requests))
        out: list[Sample] = [None] * len(responses)  # type: ignore[list-item]
        for (_, part), pieces in zip(requests, answers):
            for piece in pieces:
                out[part[piece.prompt_index]] = piece
        return out

    def _within_limits(self, rows: list[int], responses: list[_Response], tokens: int) -> list[list[int]]:
        """`rows` in requests the actor takes: at most actor.max_sequences_per_request each, and
        actor.max_tokens_per_request of context and new tokens (carried responses of several
        steps can outnumber one step's batch)."""
        a = self.cfg.actor
        parts: list[list[int]] = [[]]
        used = 0
        for i in rows:
            size = len(responses[i].sample.prompt_ids) + len(responses[i].sample.response_ids) + tokens
            if parts[-1] and (len(parts[-1]) >= a.max_sequences_per_request or used + size > a.max_tokens_per_request):
                parts.append([])
                used = 0
            parts[-1].append(i)
            used += size
        return parts

    def _group_to_saved(self, g: _Group) -> CarriedGroup:
        return CarriedGroup(batch=g.batch, prompt=g.prompt, group_id=g.responses[0].sample.group_id,
                            prompt_sha=_digest(g.record.prompt), responses=[CarriedResponse(
            sample_index=r.sample.sample_index, finish_reason=int(r.sample.finish_reason), text=r.sample.response_text,
            carries=r.carries, full=r.full, prompt_ids=r.sample.prompt_ids, response_ids=r.sample.response_ids,
            logprobs=r.sample.logprobs, versions=r.versions) for r in g.responses])

    def _group_from_saved(self, d: CarriedGroup) -> _Group:
        """A carried group of a checkpoint: its record is the data's, as the saved run drew it.
        FailedPrecondition where the run's settings no longer draw it so (`train.prompts_per_step`
        or the data changed), or where it would exceed a lowered `pipeline.max_staleness`."""
        try:
            record = self.dataset.batch(d.batch, self.cfg.train.prompts_per_step)[d.prompt]
        except IndexError as exc:
            raise FailedPrecondition(f"carried group {d.group_id} of the checkpoint is not in the run's data ({exc}): "
                                     "train.prompts_per_step or the data changed since it was saved") from None
        group = first_group_id(self.cfg, d.batch) + d.prompt
        if group != d.group_id or _digest(record.prompt) != d.prompt_sha:
            raise FailedPrecondition(f"carried group {d.group_id} of the checkpoint is not the run's group {group}: "
                                     "train.prompts_per_step or the data changed since it was saved; resume with "
                                     "the settings it was saved with")
        if any(r.carries > self.max_carries for r in d.responses):
            raise FailedPrecondition(f"carried group {group} has been carried more often than pipeline.max_staleness="
                                     f"{self.max_carries} allows; resume with the bound it was saved with")
        try:
            responses = [_Response(Sample(prompt_index=d.prompt, sample_index=r.sample_index, prompt_ids=r.prompt_ids,
                                          response_ids=r.response_ids, logprobs=r.logprobs,
                                          finish_reason=FinishReason(r.finish_reason),
                                          policy_version=int(r.versions.min()), response_text=r.text, group_id=group,
                                          sample_id=group * SAMPLES_PER_GROUP_LIMIT + r.sample_index),
                                   r.versions, r.carries, r.full) for r in d.responses]
        except (ValueError, RuntimeError) as exc:  # an unknown finish reason, a response without tokens
            raise FailedPrecondition(f"carried group {group} of the checkpoint cannot be read: {exc}") from None
        return _Group(d.batch, d.prompt, record, responses)


def _digest(prompt: Any) -> str:
    return hashlib.sha256(str(prompt).encode("utf-8", errors="surrogatepass")).hexdigest()[:16]


def _resume(s: Sample) -> Continuation:
    return Continuation(torch.cat([s.prompt_ids, s.response_ids]), [], resume_from=len(s.prompt_ids))


def _new_groups(index: int, records: list[PromptRecord], samples: list[Sample]) -> list[_Group]:
    groups = [_Group(index, p, record, []) for p, record in enumerate(records)]
    for s in sorted(samples, key=lambda s: (s.prompt_index, s.sample_index)):
        groups[s.prompt_index].responses.append(
            _Response(s, torch.full((len(s.response_ids),), s.policy_version, dtype=torch.int64)))
    return groups


def _stats(samples: list[Sample], version: int, trained: int, carried: int, open_responses: int,
           rounds: int) -> dict[str, float]:
    """The step's `partial/*` record entries (docs/metrics.md); `version`: the step's policy."""
    tokens = sum(len(s.response_ids) for s in samples)
    older = sum(int((s.token_versions < version).sum()) for s in samples)
    return {"partial/trained_groups": float(trained), "partial/carried_groups": float(carried),
            "partial/carried_responses": float(open_responses), "partial/rounds": float(rounds),
            "partial/older_token_frac": older / max(tokens, 1),
            "partial/max_lag": float(max((version - s.policy_version for s in samples), default=0))}

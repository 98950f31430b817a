"""The rollout source: what a step trains on, the same producer in both modes and for every rollout
feature (docs/architecture.md, "Where a new rollout feature goes"). It is built from stages that
compose:

- **episodes** (`episodes.py`): every sample is an episode; a single-turn sample is an episode of one
  turn, a multi-turn one alternates the model's turns with an environment's answers. The stage
  advances open episodes by rounds.
- **carried episodes** (`pipeline.partial_rollouts`): each round generates at most `token_budget`
  tokens of each episode; a step trains on the groups whose episodes have all ended (GRPO's
  statistics need the whole group) and carries the others into the next step, where the policy of
  that step generates on (a cut turn resumes where it was; nothing is tokenized again). An
  episode is carried only while training it a step later stays within `pipeline.max_staleness`
  of its oldest token's policy; else it is generated to its end in this step. At `max_staleness`
  0 nothing is ever carried: the budget only splits generation into rounds (docs/algorithms.md).
- **the dynamic-sampling filter** (`train.dynamic_sampling`, `dynamic.KeptGroups`): groups are
  scored as they end; those whose samples all score the same are dropped, and the data's next
  batches refill the step (`refills_owed`, the one place that counts them).
- **scoring as groups end**: async mode hands each finished episode to the reward and the critic at
  once (`on_finished`), carried ones when their groups end.

Sync mode pulls one step's groups (`step`); async mode's generate stage runs the same source ahead of
training, a data batch at a time (`batch`), gated by policy version, staleness and backpressure
(`pipeline.py`). Evaluation generates whole episodes through its episode stage.

Every batch a step draws is a batch of the data in the run's order (its prompts, sampling seed and
group ids are functions of its batch number, `rollout.py`): `CoordinatorState.batches_used` counts
them, and a resumed run draws the batches the saved one would have drawn next, with the episodes
it carried (`CoordinatorState.carried`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import torch

from rolefleet.actor.client import ActorClient
from rolefleet.actor.types import SAMPLES_PER_GROUP_LIMIT, FinishReason, Sample, SamplingParams
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition
from rolefleet.coordinator.agents import AgentStage
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.dynamic import KeptGroups
from rolefleet.coordinator.episodes import Episode, EpisodeStage
from rolefleet.coordinator.rollout import (
    Rollout,
    first_group_id,
    policy_version_of,
    sampling_for,
    score_items,
    spent,
    to_batch,
)
from rolefleet.coordinator.saved_state import CarriedGroup, CarriedResponse, CoordinatorState
from rolefleet.reward.client import RewardClient
from rolefleet.tasks import PromptRecord


def trains_at(cfg: RoleFleetConfig, step: int) -> int:
    """The policy version step `step` trains at: one update a step, none during the critic's warm-up."""
    return max(0, step - 1 - cfg.train.critic_warmup_steps)


@dataclass(eq=False)
class Group:
    """A prompt's episodes: which prompt of which data batch it is, and its record."""

    batch: int
    prompt: int
    record: PromptRecord
    episodes: list[Episode]

    @property
    def finished(self) -> bool:
        return all(e.done for e in self.episodes)

    def copy(self) -> Group:
        """A copy whose episodes a failed attempt can change without touching these."""
        return replace(self, episodes=[replace(e, messages=list(e.messages), pending=list(e.pending))
                                       for e in self.episodes])


class Next(Enum):
    TRAIN = "train"        # on what ended
    REFILL = "refill"      # the data's next batch joins the step
    GENERATE = "generate"  # on the open episodes, with the same policy


class RolloutSource:
    def __init__(self, cfg: RoleFleetConfig, actor: ActorClient, reward: RewardClient, dataset: PromptDataset,
                 known_version: Callable[[], int]):
        """`known_version()`: the newest policy version the coordinator knows the actor holds (it
        generates with that one or a newer)."""
        self.cfg, self.reward, self.dataset, self.known_version = cfg, reward, dataset, known_version
        # The episodes: the coordinator's rounds, or the user's agents driving the actor's endpoint.
        self.stage = AgentStage(cfg, actor, reward) if cfg.reward.agent.enabled else EpisodeStage(cfg, actor, reward)
        partial = cfg.pipeline.partial_rollouts
        self.budget = partial.token_budget if partial.enabled else None  # None: nothing is carried
        self.carried: list[Group] | None = None  # read from the state at first use (a resumed run's)
        self._after: dict[int, list[CarriedGroup]] = {}  # data batch -> what was carried after it

    @property
    def carrying(self) -> bool:
        return self.budget is not None

    # --- sync mode -----------------------------------------------------------------------------------

    async def step(self, step: int, state: CoordinatorState) -> Rollout:
        """Step `step`'s rollout: the next data batch's episodes and the carried ones, generated until
        the step has groups to train on (with dynamic sampling: informative ones, refilled)."""
        start, env_start, index = time.perf_counter(), self.stage.env_s, state.batches_used + 1
        kept = KeptGroups(self.cfg, trim=not self.carrying) if self.cfg.train.dynamic_sampling.enabled else None
        groups, batches, rounds, scored = self._carried(state), 1, 1, set()
        version = self.known_version()
        await self._round(groups, step, sampling_for(self.cfg, index), 1, fresh=index)
        while True:
            if kept is not None and (new := [g for g in groups if g.finished and id(g) not in scored]):
                scored.update(map(id, new))
                await self._score(step, new, kept)
            if kept is not None:
                kept.batches = batches  # the data batches drawn (it sees groups as they end)
            decision = self._next(groups, kept, batches, state, step)
            if decision is Next.TRAIN:
                break
            rounds += 1
            await self._round(groups, step, sampling_for(self.cfg, index), rounds,
                              fresh=index + batches if decision is Next.REFILL else None)
            batches += decision is Next.REFILL
        done = self._keep_open(groups, index + batches - 1, trained=index + batches - 1)
        generate_s = spent("generate", start + (kept.score_s if kept else 0.0))  # scoring is its own phase
        if kept is None:
            records, samples = self._samples(done)
            if not self.carrying:
                policy_version_of(samples)  # refuses a batch of several policies
            rollout = Rollout(step, records, samples, to_batch(samples), generate_s)
        else:
            state.counts.refill_batches += batches - 1
            rollout = kept.rollout(step, state.counts)
            rollout.generate_s = generate_s
        rollout.env_s = self.stage.env_s - env_start
        if self.carrying:
            rollout.stats.update(_stats(rollout.samples, version, len(rollout.records), self.carried, rounds))
        return rollout

    # --- async mode ----------------------------------------------------------------------------------

    async def batch(self, index: int, step: int, state: CoordinatorState,
                    on_samples: Callable[[list[PromptRecord], list[Sample]], None]) -> Rollout:
        """Data batch `index` (to be trained at about step `step`) and the carried episodes, generated
        until groups ended; each finished sample goes to `on_samples` as it ends (carried ones: as
        their groups end). A failed attempt changes nothing: the same call again is the same batch."""
        start, env_start = time.perf_counter(), self.stage.env_s
        groups = [g.copy() for g in self._carried(state)]
        sampling = sampling_for(self.cfg, index)
        records = self.dataset.batch(index, self.cfg.train.prompts_per_step)
        streamed: list[Sample] = []  # in the order they were handed on (their scores come in that order)

        def ended(episodes: list[Episode]) -> None:
            streamed.extend(e.sample() for e in episodes)
            on_samples(records, streamed[len(streamed) - len(episodes):])

        # Without carrying, a batch's samples are scored as they end; with it, as their groups end.
        stream = None if self.carrying else ended
        await self._round(groups, step, sampling, 1, fresh=index, records=records, on_finished=stream)
        rounds = 1
        while self._next(groups, None, 1, state, step) is not Next.TRAIN:
            rounds += 1
            await self._round(groups, step, sampling, rounds, on_finished=stream)
        done = self._keep_open(groups, index, trained=state.batches_used)
        if self.carrying:
            records, streamed = self._samples(done)
            on_samples(records, streamed)
        rollout = Rollout(index, records, streamed, to_batch(streamed), spent("generate", start),
                          env_s=self.stage.env_s - env_start)
        if self.carrying:
            rollout.stats = _stats(streamed, trains_at(self.cfg, step), len(done), self.carried, rounds)
        return rollout

    def joined_stats(self, rollout: Rollout, parts: list[Rollout], step: int) -> dict[str, float]:
        """The `partial/*` entries of step `step`'s rollout joined from several batches (async mode's
        dynamic sampling): of its samples, over the rounds of every batch it took groups from."""
        if not self.carrying:
            return {}
        rounds = int(sum(p.stats.get("partial/rounds", 0.0) for p in parts))
        return _stats(rollout.samples, trains_at(self.cfg, step), len(rollout.records), self.carried, rounds)

    def saved(self, batches_used: int) -> list[CarriedGroup]:
        """What a checkpoint after `batches_used` data batches carries: the episodes open after the
        last of them was generated (async mode generates further ahead; a resumed run generates
        those batches again)."""
        return self._after.get(batches_used, [])

    # --- the stages ----------------------------------------------------------------------------------

    async def _round(self, groups: list[Group], step: int, sampling: SamplingParams, round_: int,
                     fresh: int | None = None, records: list[PromptRecord] | None = None,
                     on_finished: Callable[[list[Episode]], None] | None = None) -> None:
        """One round: the open episodes generated on (each by the budget, or to its end where it
        cannot be carried) and, with `fresh`, data batch `fresh` begun, at once."""
        open_groups = [g for g in groups if not g.finished]
        record_of = {id(e): g.record for g in open_groups for e in g.episodes}
        tasks = [self.stage.advance(lambda e: record_of[id(e)], [e for g in open_groups for e in g.episodes],
                                    sampling, round_, lambda e: self._allowance(e, step), on_finished)]
        if fresh is not None:
            records = records or self.dataset.batch(fresh, self.cfg.train.prompts_per_step)
            lag = trains_at(self.cfg, step + 1) - self.known_version()
            allowance = self.budget if self.carrying and lag <= self.cfg.pipeline.max_staleness else None
            tasks.append(self.stage.start(records, sampling_for(self.cfg, fresh), first_group_id(self.cfg, fresh),
                                          allowance, stream=on_finished is not None, on_finished=on_finished))
        answers = await asyncio.gather(*tasks)
        if fresh is not None:
            groups += _new_groups(fresh, records, answers[-1])

    def _allowance(self, e: Episode, step: int) -> int | None:
        """Tokens episode `e` may generate in a round: the budget, or (None) to the end of its turn
        where it is not carried (it could not be trained a step later within the bound)."""
        return self.budget if self.carrying and not self._must_end(e, step) else None

    def _must_end(self, e: Episode, step: int) -> bool:
        return trains_at(self.cfg, step + 1) - e.oldest_version > self.cfg.pipeline.max_staleness

    def _next(self, groups: list[Group], kept: KeptGroups | None, batches: int, state: CoordinatorState,
              step: int) -> Next:
        """What the step does next. Without carrying, every episode ends in its step; with it, the
        step trains once a group ended, after the episodes that cannot be carried ended. With
        dynamic sampling a group needs a signal, and dropped groups are replaced (`refills_owed`),
        at most `max_batches` batches a step; past that, or with nothing open and nothing kept, the
        step trains the last groups it scored."""
        open_ = [g for g in groups if not g.finished]
        if any(self._must_end(e, step) for g in open_ for e in g.episodes if not e.done):
            return Next.GENERATE
        if open_ and not self.carrying:
            return Next.GENERATE
        if kept is None:
            return Next.TRAIN if len(open_) < len(groups) else Next.GENERATE
        room = batches < self.cfg.train.dynamic_sampling.max_batches
        if room and self.refills_owed(kept, batches, state) > 0:
            return Next.REFILL
        if kept.groups:
            return Next.TRAIN
        if open_:
            return Next.GENERATE
        return Next.REFILL if room else Next.TRAIN

    def refills_owed(self, kept: KeptGroups, batches: int, state: CoordinatorState) -> int:
        """Batches the filter's drops bring into the step now. Without carrying, one while the step
        has fewer than `prompts_per_step` groups with a signal. With it, every `prompts_per_step`
        groups dropped in the run bring one more batch (the remainder counts towards a later
        step's): groups still open are not replaced, they train in a later step."""
        if not self.carrying:
            return int(kept.groups < kept.need)
        return (state.counts.dropped_groups + kept.dropped) // kept.need - (state.counts.refill_batches + batches - 1)

    async def _score(self, step: int, groups: list[Group], kept: KeptGroups) -> None:
        """Dynamic sampling: the scores of groups that just ended, kept or dropped by `kept`."""
        records, samples = self._samples(groups)
        start = time.perf_counter()
        scores = await self.reward.score(score_items(records, samples))
        kept.add(Rollout(step, records, samples, to_batch(samples), 0.0), scores, spent("score", start), drawn=False)

    def _keep_open(self, groups: list[Group], last_batch: int, trained: int) -> list[Group]:
        """The groups that ended; the others carried into the next step (their open episodes counted
        as carried once more), and kept for a checkpoint after data batch `last_batch`, beside those
        of the batches after `trained` (the newest a checkpoint can be taken after)."""
        self.carried = [g for g in groups if not g.finished]
        for g in self.carried:
            for e in g.episodes:
                e.carries += not e.done
        for old in [i for i in self._after if i < trained]:
            del self._after[old]
        self._after[last_batch] = [_to_saved(g) for g in self.carried]
        return [g for g in groups if g.finished]

    def _carried(self, state: CoordinatorState) -> list[Group]:
        if self.carried is None:
            self.carried = [self._from_saved(g, state.step + 1) for g in state.carried]
        return list(self.carried)

    @staticmethod
    def _samples(groups: list[Group]) -> tuple[list[PromptRecord], list[Sample]]:
        return [g.record for g in groups], [e.sample(i) for i, g in enumerate(groups) for e in g.episodes]

    def _from_saved(self, d: CarriedGroup, step: int) -> Group:
        """A carried group of a checkpoint, to go on at step `step`: its record is the data's, as the
        saved run drew it. FailedPrecondition where the run's settings no longer draw it so
        (`train.prompts_per_step` or the data changed), where training it would exceed a lowered
        `pipeline.max_staleness`, or where its episodes could not be read."""
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
        try:
            episodes = [self._episode(d, group, r) for r in d.responses]
        except (ValueError, RuntimeError) as exc:  # an unknown finish reason, a response without tokens
            raise FailedPrecondition(f"carried group {group} of the checkpoint cannot be read: {exc}") from None
        bound = self.cfg.pipeline.max_staleness
        if any(trains_at(self.cfg, step) - e.oldest_version > bound for e in episodes):
            raise FailedPrecondition(f"carried group {group} began too long ago for pipeline.max_staleness={bound}: "
                                     "resume with the bound it was saved with")
        return Group(d.batch, d.prompt, record, episodes)

    def _episode(self, d: CarriedGroup, group: int, r: CarriedResponse) -> Episode:
        turns = self.stage.for_turns(sampling_for(self.cfg, d.batch))
        first = Sample(prompt_index=d.prompt, sample_index=r.sample_index, prompt_ids=r.prompt_ids,
                       response_ids=r.response_ids[:0], logprobs=r.logprobs[:0], finish_reason=FinishReason.LENGTH,
                       policy_version=int(r.versions.min()), response_text="", group_id=group,
                       sample_id=group * SAMPLES_PER_GROUP_LIMIT + r.sample_index)
        last = replace(first, finish_reason=FinishReason(r.finish_reason), response_text=r.text)
        e = Episode(first, r.response_ids, r.logprobs, r.versions,
                    r.own if r.own is not None else torch.ones(len(r.response_ids), dtype=torch.bool), last,
                    turns.max_new_tokens, self.stage.max_total if self.stage.env is not None else turns.max_new_tokens,
                    multi=self.stage.env is not None, turn_from=r.turn_from, turns=r.turns, messages=list(r.messages),
                    pending=list(r.pending), answered=r.answered, tool_calls=r.tool_calls, tool_errors=r.tool_errors,
                    tool_timeouts=r.tool_timeouts, env_error=r.env_error, env_reward=r.env_reward, carries=r.carries)
        if not len(r.response_ids):
            raise ValueError(f"sample {r.sample_index} has no response tokens")
        # Saved before version 3: ended at its stop token, at the cap, or with the model's positions full.
        e.done = r.done if r.done is not None else (r.full or e.last.finish_reason == FinishReason.STOP
                                                     or len(r.response_ids) >= e.turn_cap)
        return e


def _to_saved(g: Group) -> CarriedGroup:
    return CarriedGroup(batch=g.batch, prompt=g.prompt, group_id=g.episodes[0].first.group_id,
                        prompt_sha=_digest(g.record.prompt), responses=[CarriedResponse(
        sample_index=e.first.sample_index, finish_reason=int(e.last.finish_reason), text=e.last.response_text,
        carries=e.carries, prompt_ids=e.first.prompt_ids, response_ids=e.response, logprobs=e.logprobs,
        versions=e.versions, done=e.done, own=None if bool(e.own.all()) else e.own, turn_from=e.turn_from,
        turns=e.turns, messages=list(e.messages), pending=list(e.pending), answered=e.answered,
        tool_calls=e.tool_calls, tool_errors=e.tool_errors, tool_timeouts=e.tool_timeouts, env_error=e.env_error,
        env_reward=e.env_reward) for e in g.episodes])


def _digest(prompt: Any) -> str:
    return hashlib.sha256(str(prompt).encode("utf-8", errors="surrogatepass")).hexdigest()[:16]


def _new_groups(index: int, records: list[PromptRecord], episodes: list[Episode]) -> list[Group]:
    groups = [Group(index, p, record, []) for p, record in enumerate(records)]
    for e in sorted(episodes, key=lambda e: (e.first.prompt_index, e.first.sample_index)):
        groups[e.first.prompt_index].episodes.append(e)
    return groups


def _stats(samples: list[Sample], version: int, trained: int, carried: list[Group], rounds: int) -> dict[str, float]:
    """The step's `partial/*` record entries (docs/metrics.md); `version`: the step's policy."""
    tokens = sum(len(s.response_ids) for s in samples)
    older = sum(int((s.token_versions < version).sum()) for s in samples)
    return {"partial/trained_groups": float(trained), "partial/carried_groups": float(len(carried)),
            "partial/carried_responses": float(sum(not e.done for g in carried for e in g.episodes)),
            "partial/rounds": float(rounds), "partial/older_token_frac": older / max(tokens, 1),
            "partial/max_lag": float(max((version - s.policy_version for s in samples), default=0))}

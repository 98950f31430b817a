"""The episode stage of the rollout source (`source.py`): every sample is an episode, a conversation
whose model turns alternate with an environment's answers; a single-turn sample is an episode of one
turn with no environment (`actor.rollout.max_turns` 1, the default; docs/environments.md).

The stage advances a set of open episodes by one round:

1. one actor.Generate piece of each: a batch's prompts start their episodes; an episode whose turn
   was cut at a token allowance (partial rollouts) generates on from where it was (nothing is
   appended and nothing is tokenized again); one the environment answered continues after its
   observation, which the actor appends as its chat template renders it. Each piece is generated
   within what is left of its turn (`sampling.max_new_tokens`), of the episode's tokens
   (`actor.rollout.max_total_tokens`) and of the caller's allowance;
2. reward.Step (multi-turn only): the environment answers each turn that ended at its stop token,
   the last turn an episode may have too (its reward, its say on done).

An episode ends when the environment says done (or fails on it), a turn ends without its stop token
at its limit (no finished message to answer), `max_turns` turns are made, or no room is left under
`max_total_tokens` or the model's positions (an observation too long for them ends its episode
alone, as does one the actor would refuse: over `actor.max_prompt_bytes`, too many messages, none).
A turn cut by the allowance alone is open: the episode is generated on in a later round or step.

A finished episode is one sample: the prompt, then every turn and observation as its response, with
a loss mask (the model's tokens only; None for a single turn), the rollout logprobs and policy
version of each of the model's tokens (`token_versions`: an episode generated on across weight
updates has tokens of several policies; its `policy_version` is its oldest token's, from which the
staleness bound counts), the text of its last turn (what the reward scores).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from rolefleet.actor.client import ActorClient
from rolefleet.actor.rollout import derived_seed
from rolefleet.actor.turns import check_observation
from rolefleet.actor.types import Continuation, EpisodeStats, FinishReason, Sample, SamplingParams
from rolefleet.common import metrics
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.reward.client import RewardClient
from rolefleet.reward.types import EnvItem, EnvOutcome, ScoreResult
from rolefleet.tasks import PromptRecord


@dataclass(eq=False)  # compared by identity: one object per episode
class Episode:
    """One sample's episode so far: its tokens after the prompt (turns and observations), with the
    rollout logprob, the generating policy version and the loss mask of each."""

    first: Sample                  # its first piece: prompt ids, prompt and sample index, group and sample ids
    response: torch.Tensor         # int64 [R]
    logprobs: torch.Tensor         # float32 [R] (0 on observations)
    versions: torch.Tensor         # int64 [R] (an observation: the version of the turn that follows it)
    own: torch.Tensor              # bool [R]: the model's tokens
    last: Sample                   # its last piece (finish reason; the text of the whole last turn)
    turn_cap: int                  # tokens a turn may have (the sampling's max_new_tokens)
    limit: int                     # tokens the episode may have after its prompt
    multi: bool = False            # multi-turn: the environment answers its turns
    turn_from: int = 0             # where its last turn began in `response`
    turns: int = 1
    messages: list[dict[str, str]] = field(default_factory=list)  # assistant turns and observations, as text
    pending: list[dict[str, str]] = field(default_factory=list)   # the observation the next turn follows
    answered: bool = False         # the environment answered the last turn
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_error: str = ""
    env_reward: float | None = None
    done: bool = False
    carries: int = 0               # steps it has been carried into (partial rollouts)

    @classmethod
    def begin(cls, piece: Sample, turn_cap: int, limit: int, multi: bool) -> Episode:
        return cls(piece, piece.response_ids, piece.logprobs.float(),
                   torch.full((len(piece.response_ids),), piece.policy_version, dtype=torch.int64),
                   torch.ones(len(piece.response_ids), dtype=torch.bool), piece, turn_cap, limit, multi)

    @property
    def room(self) -> int:
        """Tokens its next piece may generate (before an observation is rendered)."""
        turn_left = self.turn_cap - self.turn_tokens if self.turn_open else self.turn_cap
        return max(0, min(turn_left, self.limit - len(self.response)))

    @property
    def context(self) -> torch.Tensor:
        return torch.cat([self.first.prompt_ids, self.response])

    @property
    def context_tokens(self) -> int:
        return len(self.first.prompt_ids) + len(self.response)

    @property
    def turn_tokens(self) -> int:
        return len(self.response) - self.turn_from

    @property
    def oldest_version(self) -> int:
        return int(self.versions[self.own].min()) if bool(self.own.any()) else self.first.policy_version

    @property
    def turn_open(self) -> bool:
        """Its last turn was cut by an allowance, not by a limit or its stop token: generated on next."""
        return not self.done and self.last.finish_reason == FinishReason.LENGTH and not self.answered

    def took(self, piece: Sample, observation: torch.Tensor, resumed: bool) -> None:
        """A piece generated on the episode: the rest of its open turn (`resumed`) or a new turn
        after `observation` (the rendered ids of `pending`)."""
        if not resumed:
            self._append(observation, torch.zeros(len(observation)), piece.policy_version, own=False)
            self.turn_from, self.turns, self.pending = len(self.response), self.turns + 1, []
        self._append(piece.response_ids, piece.logprobs.float(), piece.policy_version, own=True)
        self.last, self.answered = piece, False

    def _append(self, ids: torch.Tensor, logprobs: torch.Tensor, version: int, own: bool) -> None:
        if len(ids):
            self.response = torch.cat([self.response, ids])
            self.logprobs = torch.cat([self.logprobs, logprobs])
            self.versions = torch.cat([self.versions, torch.full((len(ids),), version, dtype=torch.int64)])
            self.own = torch.cat([self.own, torch.full((len(ids),), own, dtype=torch.bool)])

    def cut(self) -> None:
        """Its last turn cut to the episode's token limit: a turn that hit its limit."""
        drop = len(self.response) - self.limit
        if drop > 0:
            self.response, self.logprobs = self.response[:-drop], self.logprobs[:-drop]
            self.versions, self.own = self.versions[:-drop], self.own[:-drop]
            self.last = replace(self.last, finish_reason=FinishReason.LENGTH)

    def answer(self, outcome: EnvOutcome) -> None:
        self.answered = True
        self.tool_calls += outcome.tool_calls
        self.tool_errors += outcome.tool_errors
        self.tool_timeouts += outcome.tool_timeouts
        if outcome.reward is not None:
            self.env_reward = (self.env_reward or 0.0) + outcome.reward
        self.env_error = outcome.error
        self.done = self.done or outcome.done or bool(outcome.error)
        if not self.done:
            self.messages += outcome.observation
            self.pending = outcome.observation

    def sample(self, prompt_index: int | None = None) -> Sample:
        """The sample it trains as (`prompt_index`: its prompt's place in the rollout's records)."""
        stats = EpisodeStats(turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                             tool_timeouts=self.tool_timeouts, env_error=self.env_error, env_reward=self.env_reward,
                             observation_tokens=int((~self.own).sum())) if self.multi else None
        return replace(self.first, prompt_index=self.first.prompt_index if prompt_index is None else prompt_index,
                       response_ids=self.response, logprobs=self.logprobs, finish_reason=self.last.finish_reason,
                       response_text=self.last.response_text, policy_version=self.oldest_version,
                       loss_mask=None if bool(self.own.all()) else self.own, episode=stats,
                       token_versions=self.versions)


class EpisodeStage:
    """Rounds of episodes through the actor and, for multi-turn, the reward role's environment."""

    def __init__(self, cfg: RoleFleetConfig, actor: ActorClient, reward: RewardClient):
        self.actor = actor
        rollout = cfg.actor.rollout
        self.max_turns, self.max_total = rollout.max_turns, rollout.max_total_tokens
        # Multi-turn only: a single turn has no environment to answer it, and no limit but its own.
        self.env = reward if self.max_turns > 1 else None
        self.max_observation_bytes = cfg.actor.max_prompt_bytes  # what the actor takes in one observation
        # What the actor takes in one request: open episodes of several steps can outnumber a batch.
        self.max_sequences, self.max_tokens = cfg.actor.max_sequences_per_request, cfg.actor.max_tokens_per_request
        self.env_s = 0.0  # seconds spent waiting for the environment (the step's timing/env_s)

    @property
    def multi_turn(self) -> bool:
        return self.env is not None

    def for_turns(self, sampling: SamplingParams) -> SamplingParams:
        """The sampling of one turn: multi-turn turns end at the chat template's end-of-turn token."""
        if self.env is None:
            return sampling
        return replace(sampling, stop_at_end_of_turn=True, max_new_tokens=min(sampling.max_new_tokens, self.max_total))

    def _begin(self, piece: Sample, turns: SamplingParams, allowance: int | None) -> Episode:
        limit = self.max_total if self.env is not None else turns.max_new_tokens
        return self._settled(Episode.begin(piece, turns.max_new_tokens, limit, self.env is not None), allowance)

    async def start(self, records: list[PromptRecord], sampling: SamplingParams, first_group_id: int,
                    allowance: int | None, stream: bool = False,
                    on_finished: Callable[[list[Episode]], None] | None = None) -> list[Episode]:
        """1-2 for a batch's prompts: their episodes after their first piece (and the environment's
        answer to it); `stream`: finished episodes are handed to `on_finished` as the actor's samples
        arrive, before the others."""
        turns = self.for_turns(sampling)
        first = turns if allowance is None else replace(turns, max_new_tokens=min(turns.max_new_tokens, allowance))
        prompts = [r.prompt for r in records]
        episodes: list[Episode] = []
        if stream:
            async for part in self.actor.generate_stream(prompts, first, first_group_id):
                fresh = [self._begin(p, turns, allowance) for p in part]
                episodes += fresh
                if on_finished and (done := [e for e in fresh if e.done]):
                    on_finished(done)
        else:
            episodes = [self._begin(p, turns, allowance)
                        for p in await self.actor.generate(prompts, first, first_group_id)]
        episodes.sort(key=lambda e: (e.first.prompt_index, e.first.sample_index))
        await self._answer(lambda e: records[e.first.prompt_index], episodes, on_finished, already=stream)
        return episodes

    async def advance(self, records: Callable[[Episode], PromptRecord], episodes: list[Episode],
                      sampling: SamplingParams, round_: int, allowance: Callable[[Episode], int | None],
                      on_finished: Callable[[list[Episode]], None] | None = None) -> None:
        """1-2 for open episodes: one more piece of each (`allowance(e)`: at most so many tokens;
        None: to the end of its turn), then the environment's answers."""
        open_ = [e for e in episodes if not e.done]
        if not open_:
            return
        sampling = self.for_turns(sampling)
        by_kind: dict[tuple[bool, int], list[Episode]] = {}
        for e in open_:
            limit = e.room if (a := allowance(e)) is None else min(a, e.room)
            by_kind.setdefault((e.turn_open, limit), []).append(e)
        requests = [(kind, part) for kind, group in by_kind.items() for part in self._within_limits(group, kind[1])]
        answers = await asyncio.gather(*(self._pieces(group, sampling, round_, limit, resumed)
                                         for (resumed, limit), group in requests))
        for ((resumed, _), group), pieces in zip(requests, answers):
            for e, piece in zip(group, pieces):
                observation = piece.prompt_ids[e.context_tokens:] if not resumed else torch.zeros(0, dtype=torch.int64)
                # The observation fills the episode's tokens, or the model's positions (the actor's
                # empty piece): the episode ends before it.
                if len(e.response) + len(observation) >= e.limit or not len(piece.response_ids):
                    e.done = True
                    continue
                e.took(piece, observation, resumed)
                e.cut()
                self._settled(e, allowance(e))
        await self._answer(records, open_, on_finished)

    async def _pieces(self, group: list[Episode], sampling: SamplingParams, round_: int, limit: int,
                      resumed: bool) -> list[Sample]:
        """One request: the next piece of each episode of `group`, in its order. A new turn is seeded by
        the round; a resumed one by the round, its first episode and its length (the same request
        the same tokens)."""
        if resumed:
            seed = derived_seed(derived_seed(derived_seed(sampling.seed, 1 + round_), group[0].first.sample_id), limit)
            continuations = [Continuation(e.context, [], resume_from=len(e.first.prompt_ids) + e.turn_from)
                             for e in group]
        else:
            seed = derived_seed(sampling.seed, round_)
            continuations = [Continuation(e.context, e.pending) for e in group]
        pieces = await self.actor.generate([], replace(sampling, n=1, seed=seed, max_new_tokens=limit), 0,
                                           continuations)
        return sorted(pieces, key=lambda s: s.prompt_index)

    def _within_limits(self, group: list[Episode], limit: int) -> list[list[Episode]]:
        """`group` in requests the actor takes: at most actor.max_sequences_per_request episodes and
        actor.max_tokens_per_request of context and new tokens each."""
        parts: list[list[Episode]] = [[]]
        used = 0
        for e in group:
            size = e.context_tokens + limit
            if parts[-1] and (len(parts[-1]) >= self.max_sequences or used + size > self.max_tokens):
                parts.append([])
                used = 0
            parts[-1].append(e)
            used += size
        return parts

    def _settled(self, e: Episode, allowance: int | None) -> Episode:
        """Whether its last piece ended it: the turn hit its limit (not only the allowance), or the
        episode has no room left."""
        if e.done:
            return e
        if e.last.finish_reason == FinishReason.STOP:
            e.done = self.env is None  # a single turn that ended; a multi-turn one is the environment's to answer
            return e
        cut_by_allowance = allowance is not None and len(e.last.response_ids) >= allowance
        if not cut_by_allowance or e.turn_tokens >= e.turn_cap or len(e.response) >= e.limit:
            e.done = True  # a turn at its limit is no finished message for the environment to answer
        return e

    async def _answer(self, record_of: Callable[[Episode], PromptRecord], episodes: list[Episode],
                      on_finished: Callable[[list[Episode]], None] | None, already: bool = False) -> None:
        """2. The environment's answer to each episode's finished turn; episodes at their turn or
        token limit end. Those that ended are handed to `on_finished` (`already`: those that had
        ended before this were handed on)."""
        ended_before = {id(e) for e in episodes if e.done} if already else set()
        if self.env is not None and (asked := [e for e in episodes if not e.done and not e.turn_open]):
            await self._environment(record_of, asked)
        for e in episodes:
            if not e.done and not e.turn_open and (e.turns >= self.max_turns or len(e.response) >= e.limit):
                e.done = True
        if on_finished and (ended := [e for e in episodes if e.done and id(e) not in ended_before]):
            on_finished(ended)

    async def _environment(self, record_of, episodes: list[Episode]) -> None:
        start = time.perf_counter()
        items = [EnvItem(_text(record_of(e).prompt), record_of(e).ground_truth,
                         [*e.messages, {"role": "assistant", "content": e.last.response_text}], record_of(e).extra)
                 for e in episodes]
        outcomes = await self.env.step(items)
        seconds = time.perf_counter() - start
        self.env_s += seconds
        metrics.STAGE_SECONDS.labels("coordinator", "environment").inc(seconds)
        for e, outcome in zip(episodes, outcomes):
            e.messages.append({"role": "assistant", "content": e.last.response_text})
            if not (outcome.done or outcome.error) and (problem := self._unsendable(outcome.observation)):
                # What the actor would refuse ends this episode here, not the whole turn request.
                outcome = replace(outcome, observation=[], error=problem)
            e.answer(outcome)

    def _unsendable(self, observation: list[dict[str, str]]) -> str:
        """Why the actor would refuse to continue with `observation` (the checks it makes), or ''."""
        try:
            check_observation(observation, "observation", self.max_observation_bytes)
        except (InvalidArgument, LimitExceeded) as exc:
            return str(exc)
        return ""

    async def generate(self, records: list[PromptRecord], sampling: SamplingParams,
                       first_group_id: int = 0) -> list[Sample]:
        """Whole episodes of `records` (evaluation, and tests): rounds until every one has ended."""
        episodes = await self.start(records, sampling, first_group_id, None)
        round_ = 1
        while any(not e.done for e in episodes):
            round_ += 1
            await self.advance(lambda e: records[e.first.prompt_index], episodes, sampling, round_, lambda e: None)
        return [e.sample() for e in episodes]


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else str(prompt)


def with_env_rewards(result: ScoreResult, samples: list[Sample]) -> ScoreResult:
    """The scores with each conversation's environment reward added (as the source `env`), when
    the environment gave any."""
    rewards = [s.episode.env_reward if s.episode is not None else None for s in samples]
    if all(r is None for r in rewards):
        return result
    env = torch.tensor([float("nan") if r is None else r for r in rewards], dtype=torch.float32)
    return ScoreResult(result.total + torch.nan_to_num(env), {**result.sources, "env": env}, result.errors)


def episode_metrics(samples: list[Sample], prefix: str = "episode") -> dict[str, float]:
    """Turns, tool calls, tool errors and timeouts per sample, environment failures, and the share
    of response tokens that are observations (masked out of training)."""
    stats = [s.episode or EpisodeStats() for s in samples]
    n = max(len(stats), 1)
    tokens = sum(len(s.response_ids) for s in samples)
    return {
        f"{prefix}/turns/mean": sum(e.turns for e in stats) / n,
        f"{prefix}/turns/max": float(max((e.turns for e in stats), default=0)),
        f"{prefix}/tool_calls/mean": sum(e.tool_calls for e in stats) / n,
        f"{prefix}/tool_use_rate": sum(e.tool_calls > 0 for e in stats) / n,
        f"{prefix}/tool_errors/mean": sum(e.tool_errors for e in stats) / n,
        f"{prefix}/tool_timeouts/mean": sum(e.tool_timeouts for e in stats) / n,
        f"{prefix}/env_errors": float(sum(bool(e.env_error) for e in stats)),
        f"{prefix}/masked_token_frac": sum(e.observation_tokens for e in stats) / max(tokens, 1),
    }

"""Multi-turn rollouts (`actor.rollout.max_turns` > 1; docs/environments.md): conversations in
which the model's turns alternate with an environment's answers (tool results, its messages).

Each round, for every conversation still open:

1. actor.Generate one assistant turn (round 1 from the prompts; later rounds continue each
   conversation from its tokens so far, the actor appending the observation as its chat template
   renders it: nothing generated is tokenized again), ending at the chat template's end-of-turn
   token (`stop_at_end_of_turn`);
2. reward.Step: the environment answers each turn that ended at its stop token (an observation,
   done, optionally a reward), the last turn a conversation may have too.

A conversation ends when the environment says done (or fails on it), a turn ends without its stop
token (it hit sampling.max_new_tokens: no finished message to answer), `max_turns` turns are made,
or no room is left under `actor.rollout.max_total_tokens` or the model's positions (an observation
too long for them ends its conversation alone, as does one the actor would refuse: over
`actor.max_prompt_bytes`, too many messages, none). Finished conversations are handed on at once,
while the others go on, so the reward scores short conversations while long ones still run.

A finished conversation is one sample: the prompt, then every turn and observation as its response,
with a loss mask (the model's tokens only), the rollout logprobs of the model's tokens (0 on the
observations, which the mask leaves out of every use), the text of its last turn (what the reward
scores) and the policy version of its first turn. In async mode a weight sync may land between two
rounds; a sample's lag is counted from its first turn, its oldest part (docs/algorithms.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
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


@dataclass(eq=False)  # compared by identity: one object per conversation
class _Conversation:
    first: Sample                  # its first turn (ids, group, version)
    context: torch.Tensor          # prompt + everything so far, int64
    parts: list[tuple[torch.Tensor, torch.Tensor, bool]] = field(default_factory=list)  # (ids, logprobs, model's)
    messages: list[dict[str, str]] = field(default_factory=list)  # assistant turns and observations, as text
    last: Sample | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_error: str = ""
    env_reward: float | None = None
    done: bool = False
    pending: list[dict[str, str]] = field(default_factory=list)  # the observation the next turn follows

    @property
    def response_tokens(self) -> int:
        return sum(len(ids) for ids, _, _ in self.parts)

    def took(self, turn: Sample, observation: torch.Tensor) -> None:
        """A turn generated after `observation` (empty for the first)."""
        if len(observation):
            self.parts.append((observation, torch.zeros(len(observation)), False))
        self.parts.append((turn.response_ids, turn.logprobs, True))
        self.messages.append({"role": "assistant", "content": turn.response_text})
        self.context = torch.cat([turn.prompt_ids, turn.response_ids])
        self.last, self.turns = turn, self.turns + 1
        # A turn cut off by its token limit is no finished message for the environment to answer.
        self.done = self.done or turn.finish_reason != FinishReason.STOP

    def answered(self, outcome: EnvOutcome) -> None:
        self.tool_calls += outcome.tool_calls
        self.tool_errors += outcome.tool_errors
        self.tool_timeouts += outcome.tool_timeouts
        if outcome.reward is not None:
            self.env_reward = (self.env_reward or 0.0) + outcome.reward
        self.env_error = outcome.error
        self.done = outcome.done or bool(outcome.error)

    def sample(self) -> Sample:
        ids, logprobs, own = zip(*self.parts)
        mask = torch.cat([torch.full((len(i),), o, dtype=torch.bool) for i, o in zip(ids, own)])
        stats = EpisodeStats(turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                             tool_timeouts=self.tool_timeouts, env_error=self.env_error, env_reward=self.env_reward,
                             observation_tokens=int((~mask).sum()))
        return replace(self.first, response_ids=torch.cat(ids), logprobs=torch.cat(logprobs).float(),
                       finish_reason=self.last.finish_reason, response_text=self.last.response_text,
                       loss_mask=mask if self.turns > 1 else None, episode=stats)


class Episodes:
    """Multi-turn rollouts through the actor and the reward role's environment. `stream` and
    `generate` take what `ActorClient.generate_stream` / `generate` take."""

    def __init__(self, cfg: RoleFleetConfig, actor: ActorClient, reward: RewardClient):
        self.actor, self.reward = actor, reward
        self.max_turns, self.max_total = cfg.actor.rollout.max_turns, cfg.actor.rollout.max_total_tokens
        self.max_observation_bytes = cfg.actor.max_prompt_bytes  # what the actor takes in one observation
        self.env_s = 0.0  # seconds spent waiting for the environment (the step's timing/env_s)

    async def generate(self, records: list[PromptRecord], sampling: SamplingParams,
                       first_group_id: int = 0) -> list[Sample]:
        samples = [s async for chunk in self.stream(records, sampling, first_group_id) for s in chunk]
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))

    async def stream(self, records: list[PromptRecord], sampling: SamplingParams,
                     first_group_id: int = 0) -> AsyncIterator[list[Sample]]:
        """Finished conversations, a list per round, as they finish."""
        sampling = replace(sampling, stop_at_end_of_turn=True,
                           max_new_tokens=min(sampling.max_new_tokens, self.max_total))
        first = await self.actor.generate([r.prompt for r in records], sampling, first_group_id)
        open_ = []
        for turn in first:
            conversation = _Conversation(first=turn, context=turn.prompt_ids)
            conversation.took(turn, torch.zeros(0, dtype=torch.int64))
            open_.append(conversation)
        round_ = 1
        while open_:
            # The environment answers every turn that ended at its stop token, the last one a
            # conversation may have too (its reward, its say on done).
            if answerable := [c for c in open_ if not c.done]:
                await self._answer(records, answerable)
            finished = [c for c in open_ if c.done or c.turns >= self.max_turns or c.response_tokens >= self.max_total]
            if finished:
                yield [c.sample() for c in finished]
            open_ = [c for c in open_ if c not in finished]
            if open_:
                round_ += 1
                await self._next_turns(open_, sampling, round_)

    async def _answer(self, records: list[PromptRecord], conversations: list[_Conversation]) -> None:
        """2. The environment's answer to each conversation's last turn."""
        start = time.perf_counter()
        items = [EnvItem(_text(records[c.first.prompt_index].prompt), records[c.first.prompt_index].ground_truth,
                         list(c.messages), records[c.first.prompt_index].extra) for c in conversations]
        outcomes = await self.reward.step(items)
        seconds = time.perf_counter() - start
        self.env_s += seconds
        metrics.STAGE_SECONDS.labels("coordinator", "environment").inc(seconds)
        for conversation, outcome in zip(conversations, outcomes):
            if not (outcome.done or outcome.error) and (problem := self._unsendable(outcome.observation)):
                # What the actor would refuse ends this conversation here, not the whole turn request.
                outcome = replace(outcome, observation=[], error=problem)
            conversation.answered(outcome)
            if not conversation.done:
                conversation.messages += outcome.observation
                conversation.pending = outcome.observation

    def _unsendable(self, observation: list[dict[str, str]]) -> str:
        """Why the actor would refuse to continue with `observation` (the checks it makes), or ''."""
        try:
            check_observation(observation, "observation", self.max_observation_bytes)
        except (InvalidArgument, LimitExceeded) as exc:
            return str(exc)
        return ""

    async def _next_turns(self, conversations: list[_Conversation], sampling: SamplingParams, round_: int) -> None:
        """1. One more turn of each conversation the environment left open, each within what is left
        of its token budget (requests grouped by that budget)."""
        by_budget: dict[int, list[_Conversation]] = {}
        for c in conversations:
            by_budget.setdefault(min(sampling.max_new_tokens, self.max_total - c.response_tokens), []).append(c)
        seeded = replace(sampling, n=1, seed=derived_seed(sampling.seed, round_))
        answers = await asyncio.gather(*(self.actor.generate(
            [], replace(seeded, max_new_tokens=budget), 0,
            [Continuation(c.context, c.pending) for c in group]) for budget, group in by_budget.items()))
        for group, turns in zip(by_budget.values(), answers):
            for c, turn in zip(group, sorted(turns, key=lambda s: s.prompt_index)):
                observation = turn.prompt_ids[len(c.context):]
                room = self.max_total - c.response_tokens - len(observation)
                # The observation fills the budget, or the model's positions (the actor's empty turn):
                # the conversation ends before it.
                if room <= 0 or not len(turn.response_ids):
                    c.done = True
                    continue
                if len(turn.response_ids) > room:  # cut to the budget: a turn that hit its limit
                    turn = replace(turn, response_ids=turn.response_ids[:room], logprobs=turn.logprobs[:room],
                                   finish_reason=FinishReason.LENGTH)
                c.took(turn, observation)


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

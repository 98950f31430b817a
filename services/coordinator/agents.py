"""The episode stage of agent-driven episodes (`reward.agent`; docs/environments.md, "Your own
agent"), in place of `episodes.EpisodeStage` in the rollout source (`source.py`): the same episodes,
made by the user's agent code instead of the coordinator's rounds.

For a batch's prompts:

1. actor.OpenSessions: one session of the actor's OpenAI-compatible endpoint per sample, sampling
   with the batch's sampling (the run's temperature: what the trainer's recompute assumes);
2. reward.RunAgents: each sample's agent drives its session (an `openai` client of its own key)
   and returns the episode's reward; with `stream`, in parts of whole groups (one per agent
   worker), so that async mode scores groups as their part ends. With `reward.agent.external`,
   agents outside the cluster claim the sessions (their tasks were opened with them) and post
   their rewards, which actor.SessionRewards is asked for until all are in or the deadline passed;
3. actor.CloseSessions: each session's trajectory (the exact ids the model saw and sampled, with
   their logprobs and policy versions; rendered messages masked out) becomes its episode, done.

An agent's episodes always end in the step that began them (an agent holds its episode to its
end): nothing is carried, so partial rollouts' token budget does not cut them. An episode whose
agent failed (raised, timed out, returned no number) trains nothing: its tokens are masked out of
the loss and its group counts it at `reward.fallback_score` (its error counted as
`episode/env_errors`); one whose agent made no completion at all gets a one-token stand-in of
the policy's, masked the same way, so that its group keeps its size.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import torch

from rolefleet.actor.client import ActorClient
from rolefleet.actor.types import SAMPLES_PER_GROUP_LIMIT, AgentTask, Sample, SamplingParams, Trajectory
from rolefleet.common import metrics
from rolefleet.common.config import ConfigError, RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition
from rolefleet.coordinator.episodes import Episode
from rolefleet.reward.client import RewardClient
from rolefleet.reward.types import AgentItem, AgentOutcome
from rolefleet.tasks import PromptRecord

POLL_S = 0.2  # how often the rewards of agents outside the cluster are asked for


class AgentStage:
    """Episodes of a batch's prompts, each driven to its end by the user's agent."""

    env = None  # no environment of the coordinator's answers the turns: the agent does

    def __init__(self, cfg: RoleFleetConfig, actor: ActorClient, reward: RewardClient):
        self.actor, self.reward = actor, reward
        self.url = (cfg.actor.endpoint.url or "").rstrip("/")
        if not self.url and not cfg.reward.agent.external:  # external agents are told where they dialled
            raise ConfigError("actor.endpoint.url: the base URL agents dial the actor's endpoint at is unknown; "
                              "set it (http://actor:8300 in compose) or a fixed actor.endpoint.port")
        self.max_total = cfg.episode_cap
        agent = cfg.reward.agent
        self.workers, self.concurrency, self.timeout_s = agent.workers, agent.concurrency, agent.timeout_s
        self.external = agent.external  # agents outside the cluster claim the episodes and post their rewards
        self.env_s = 0.0  # seconds spent waiting for the agents (the step's timing/env_s)

    @property
    def multi_turn(self) -> bool:
        return True  # its episodes' statistics and env time are the step's record's

    def for_turns(self, sampling: SamplingParams) -> SamplingParams:
        return replace(sampling, stop_at_end_of_turn=True)

    async def start(self, records: list[PromptRecord], sampling: SamplingParams, first_group_id: int,
                    allowance: int | None, stream: bool = False, on_finished=None, prefix: str = "s") -> list[Episode]:
        """1-3 for `records`: their episodes, ended (`allowance` does not apply: see the module);
        `stream`: handed to `on_finished` a part of whole groups at a time, as its agents return."""
        start = time.perf_counter()
        groups = [[(p, i) for i in range(sampling.n)] for p in range(len(records))]
        # Streamed: a part of whole groups per agent worker (each RunAgents call runs in one worker
        # at a time), so that every worker runs agents and groups are handed on as their part ends.
        per_part = len(records) if not stream else max(1, min(self.concurrency // sampling.n,
                                                              -(-len(records) // self.workers)))
        parts = [[pair for g in groups[k:k + per_part] for pair in g] for k in range(0, len(groups), per_part)]

        async def run(part: list[tuple[int, int]]) -> list[Episode]:
            episodes = await self._episodes(records, part, sampling, first_group_id, prefix)
            if on_finished is not None:
                on_finished(episodes)
            return episodes

        episodes = [e for done in await asyncio.gather(*(run(part) for part in parts)) for e in done]
        seconds = time.perf_counter() - start
        self.env_s += seconds
        metrics.STAGE_SECONDS.labels("coordinator", "environment").inc(seconds)
        if episodes and all(e.env_error for e in episodes):
            raise FailedPrecondition(f"reward.agent failed on every episode of the batch; the first: "
                                     f"{episodes[0].env_error}")
        return sorted(episodes, key=lambda e: (e.first.prompt_index, e.first.sample_index))

    async def advance(self, *args, **kwargs) -> None:
        """Nothing is left open: an agent's episode ends within `start`."""

    async def generate(self, records: list[PromptRecord], sampling: SamplingParams,
                       first_group_id: int = 0) -> list[Sample]:
        """Whole episodes of `records` (evaluation): their own sessions, apart from training's."""
        return [e.sample() for e in await self.start(records, sampling, first_group_id, None, prefix="e")]

    async def _episodes(self, records: list[PromptRecord], pairs: list[tuple[int, int]], sampling: SamplingParams,
                        first_group_id: int, prefix: str) -> list[Episode]:
        ids = [f"{prefix}{(first_group_id + p) * SAMPLES_PER_GROUP_LIMIT + i}" for p, i in pairs]
        try:
            if self.external:
                tasks = [AgentTask(records[p].given, records[p].ground_truth, records[p].extra) for p, _ in pairs]
                await self.actor.open_sessions(ids, replace(sampling, n=1), tasks)
                outcomes = await self._posted(ids)
            else:
                keys = await self.actor.open_sessions(ids, replace(sampling, n=1))
                outcomes = await self.reward.run_agents([
                    AgentItem(f"{self.url}/sessions/{sid}/v1", key, records[p].given, records[p].ground_truth,
                              records[p].extra) for sid, key, (p, _) in zip(ids, keys, pairs)])
        finally:
            trajectories = await self.actor.close_sessions(ids)
        stand_ins = await self._stand_ins(records, pairs, trajectories, sampling)
        return [self._episode(records, p, i, first_group_id, t, o, stand_ins.get(k), sampling)
                for k, ((p, i), t, o) in enumerate(zip(pairs, trajectories, outcomes))]

    async def _posted(self, ids: list[str]) -> list[AgentOutcome]:
        """The rewards agents outside the cluster post for `ids`, waited for until every one is
        posted or `reward.agent.timeout_s` has passed (those then fail)."""
        deadline = time.monotonic() + self.timeout_s
        while None in (rewards := await self.actor.session_rewards(ids)) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return [AgentOutcome(reward=r) if r is not None else AgentOutcome(
            error=f"no reward posted within reward.agent.timeout_s={self.timeout_s:g} (POST /v1/episodes/<id>/reward)")
            for r in rewards]

    async def _stand_ins(self, records: list[PromptRecord], pairs: list[tuple[int, int]],
                         trajectories: list[Trajectory], sampling: SamplingParams) -> dict[int, Sample]:
        """A one-token sample of the policy's for each episode whose agent made no completion."""
        empty = [k for k, t in enumerate(trajectories) if not t.turns]
        if not empty:
            return {}
        one = replace(sampling, n=1, max_new_tokens=1)
        samples = await self.actor.generate([records[pairs[k][0]].prompt for k in empty], one, 0)
        return {empty[s.prompt_index]: s for s in samples}

    def _episode(self, records: list[PromptRecord], p: int, i: int, first_group_id: int, t: Trajectory,
                 outcome: AgentOutcome, stand_in: Sample | None, sampling: SamplingParams) -> Episode:
        group = first_group_id + p
        error = outcome.error or (t.error if not t.turns else "")
        if stand_in is not None:
            t = replace(t, prompt_ids=stand_in.prompt_ids, response_ids=stand_in.response_ids,
                        logprobs=stand_in.logprobs.float(), versions=torch.full_like(stand_in.response_ids,
                                                                                     stand_in.policy_version),
                        own=torch.ones(len(stand_in.response_ids), dtype=torch.bool),
                        finish_reason=stand_in.finish_reason, last_text=stand_in.response_text)
        # A failed agent's episode trains nothing (its failure says nothing of the policy's tokens).
        own = t.own if not error else torch.zeros_like(t.own)
        version = int(t.versions[t.own].min()) if bool(t.own.any()) else 0
        first = Sample(prompt_index=p, sample_index=i, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                       logprobs=t.logprobs, finish_reason=t.finish_reason, policy_version=version,
                       response_text=t.last_text, group_id=group, sample_id=group * SAMPLES_PER_GROUP_LIMIT + i)
        return Episode(first, t.response_ids, t.logprobs, t.versions, own, first, sampling.max_new_tokens,
                       self.max_total, multi=True, turns=max(t.turns, 1), tool_calls=t.tool_calls, env_error=error,
                       env_reward=None if error else outcome.reward, done=True)

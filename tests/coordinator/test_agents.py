"""The agent stage (`coordinator/agents.py`) over stand-in clients: a session per sample, the agents'
rewards on their episodes, the trajectories' ids and masks as the actor closed them, and a failed
agent's episode training nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rolefleet.actor.types import FinishReason, Sample, SamplingParams, Trajectory
from rolefleet.common.config import ConfigError, parse_config
from rolefleet.common.errors import FailedPrecondition
from rolefleet.coordinator.agents import AgentStage
from rolefleet.reward.types import AgentOutcome
from rolefleet.tasks import PromptRecord

RECORDS = [PromptRecord("<rendered 0>", "1", {"k": 0}, [{"role": "user", "content": "q0"}]),
           PromptRecord("<rendered 1>", "2", {"k": 1}, [{"role": "user", "content": "q1"}])]
SAMPLING = SamplingParams(temperature=0.9, max_new_tokens=8, n=2, seed=11)


class Actor:
    def __init__(self, empty: set[str] = frozenset()):
        self.opened, self.closed, self.generated, self.empty = [], [], [], empty

    async def open_sessions(self, ids, sampling):
        self.opened.append((list(ids), sampling))
        return [f"key-{i}" for i in ids]

    async def close_sessions(self, ids):
        self.closed.append(list(ids))
        out = []
        for sid in ids:
            if sid in self.empty:
                out.append(Trajectory(sid, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                      torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                                      torch.zeros(0, dtype=torch.bool), FinishReason.LENGTH, 0, ""))
                continue
            out.append(Trajectory(sid, torch.tensor([1, 2]), torch.tensor([5, 6, 7, 8]),
                                  torch.tensor([-1.0, -1.0, 0.0, -1.0]), torch.tensor([3, 3, 4, 4]),
                                  torch.tensor([True, True, False, True]), FinishReason.STOP, 2, f"text {sid}",
                                  tool_calls=1))
        return out

    async def generate(self, prompts, sampling, first_group_id=0, continuations=None):
        self.generated.append((list(prompts), sampling))
        return [Sample(i, 0, torch.tensor([9]), torch.tensor([4]), torch.tensor([-2.0]), FinishReason.LENGTH, 5, "x")
                for i in range(len(prompts))]


class Reward:
    def __init__(self, fail: set[str] = frozenset()):
        self.calls, self.fail = [], fail

    async def run_agents(self, items):
        self.calls.append(items)
        return [AgentOutcome(error="boom") if any(item.base_url.endswith(f"/{f}/v1") for f in self.fail)
                else AgentOutcome(reward=float(len(item.ground_truth)) / 2) for item in items]


def stage(actor, reward) -> AgentStage:
    cfg = parse_config({"model": {"model_name_or_path": "m"}, "reward": {"agent": {"path": "a.py:agent"}}},
                       ["actor.endpoint.url=http://actor:8300/"])
    return AgentStage(cfg, actor, reward)


def test_each_sample_is_a_session_whose_agent_gets_the_prompt_as_the_data_gave_it():
    actor, reward = Actor(), Reward()
    episodes = asyncio.run(stage(actor, reward).start(RECORDS, SAMPLING, 10, allowance=3))
    ids = [f"s{g * 2**20 + i}" for g in (10, 11) for i in (0, 1)]
    assert actor.opened[0][0] == ids and actor.closed == [ids]
    assert actor.opened[0][1].n == 1 and actor.opened[0][1].temperature == pytest.approx(0.9)
    items = reward.calls[0]
    assert [i.base_url for i in items] == [f"http://actor:8300/sessions/{sid}/v1" for sid in ids]
    assert [i.key for i in items] == [f"key-{sid}" for sid in ids]
    assert items[0].prompt == [{"role": "user", "content": "q0"}] and items[3].extra == {"k": 1}
    # Every episode ended (the allowance does not cut an agent's), with the trajectory as closed.
    assert all(e.done for e in episodes)
    s = episodes[0].sample()
    assert s.prompt_ids.tolist() == [1, 2] and s.response_ids.tolist() == [5, 6, 7, 8]
    assert s.loss_mask.tolist() == [True, True, False, True] and s.token_versions.tolist() == [3, 3, 4, 4]
    assert s.policy_version == 3 and s.response_text.startswith("text s")
    assert (s.group_id, s.sample_id) == (10, 10 * 2**20)
    assert s.episode.turns == 2 and s.episode.tool_calls == 1 and s.episode.env_reward == 0.5


def test_a_failed_agent_s_episode_trains_nothing_and_one_that_made_no_completion_keeps_its_group_whole():
    failed, empty = f"s{10 * 2**20}", f"s{10 * 2**20 + 1}"
    actor, reward = Actor(empty={empty}), Reward(fail={failed, empty})
    episodes = asyncio.run(stage(actor, reward).start(RECORDS, SAMPLING, 10, None))
    bad, stand_in = episodes[0].sample(), episodes[1].sample()
    assert not bad.loss_mask.any() and bad.episode.env_error == "boom" and bad.episode.env_reward is None
    # The stand-in: one token of the policy's for the rendered prompt, masked the same way.
    assert actor.generated == [(["<rendered 0>"], actor.generated[0][1])] and actor.generated[0][1].max_new_tokens == 1
    assert stand_in.response_ids.tolist() == [4] and not stand_in.loss_mask.any()
    assert [len(e.response) > 0 for e in episodes] == [True] * 4
    assert episodes[2].sample().loss_mask is not None and episodes[2].sample().loss_mask.any()


def test_every_agent_failing_fails_the_batch_naming_the_key():
    ids = {f"s{g * 2**20 + i}" for g in (10, 11) for i in (0, 1)}
    with pytest.raises(FailedPrecondition, match="reward.agent failed on every episode.*boom"):
        asyncio.run(stage(Actor(), Reward(fail=ids)).start(RECORDS, SAMPLING, 10, None))


def test_streamed_groups_are_handed_on_as_their_agents_return_and_evaluation_has_its_own_sessions():
    actor, reward = Actor(), Reward()
    handed = []
    asyncio.run(stage(actor, reward).start(RECORDS, SAMPLING, 0, None, stream=True, on_finished=handed.append))
    # Two agent workers (the default): a part of whole groups each, handed on as each part ends.
    assert sorted(len(h) for h in handed) == [2, 2] and len(reward.calls) == 2
    samples = asyncio.run(stage(actor, reward).generate(RECORDS, SAMPLING))
    assert len(samples) == 4 and all(sid.startswith("e") for sid in actor.opened[-1][0])


def test_an_agent_needs_the_url_of_the_actor_s_endpoint():
    cfg = parse_config({"model": {"model_name_or_path": "m"}, "reward": {"agent": {"path": "a.py:agent"}}})
    assert cfg.actor.endpoint.enabled and cfg.reward.function == "none"
    with pytest.raises(ConfigError, match="actor.endpoint.url"):
        AgentStage(cfg, Actor(), Reward())
    with pytest.raises(ConfigError, match="reward.agent or reward.env, not both"):
        parse_config({"model": {"model_name_or_path": "m"},
                      "reward": {"agent": {"path": "a.py:agent"}, "env": {"name": "feedback"}}})
    with pytest.raises(ConfigError, match="path/to/file.py:function"):
        parse_config({"model": {"model_name_or_path": "m"}, "reward": {"agent": {"path": "agent.py"}}})


class OutsideActor(Actor):
    """Agents outside the cluster: the rewards of all but `never` are posted on the second poll."""

    def __init__(self, never: set[str] = frozenset()):
        super().__init__()
        self.polls, self.tasks, self.never = 0, [], never

    async def open_sessions(self, ids, sampling, tasks=None):
        self.tasks.append(tasks)
        return await super().open_sessions(ids, sampling)

    async def session_rewards(self, ids):
        self.polls += 1
        return [None if self.polls < 2 or sid in self.never else 0.75 for sid in ids]


def test_agents_outside_the_cluster_get_the_tasks_and_their_posted_rewards_are_the_episodes(monkeypatch):
    import rolefleet.coordinator.agents as agents

    monkeypatch.setattr(agents, "POLL_S", 0.01)
    cfg = parse_config({"model": {"model_name_or_path": "m"}, "reward": {"agent": {"external": True, "timeout_s": 0.3}}})
    never = f"s{10 * 2**20 + 1}"
    actor, reward = OutsideActor(never={never}), Reward()
    episodes = asyncio.run(AgentStage(cfg, actor, reward).start(RECORDS, SAMPLING, 10, None))
    assert reward.calls == []  # the reward role runs no agent
    tasks = actor.tasks[0]
    assert [(t.prompt, t.ground_truth, t.extra) for t in tasks[:2]] == [(RECORDS[0].given, "1", {"k": 0})] * 2
    assert actor.polls >= 2 and len(actor.closed) == 1
    assert [e.env_reward for e in episodes] == [0.75, None, 0.75, 0.75]
    assert "no reward posted within reward.agent.timeout_s=0.3" in episodes[1].env_error
    assert not episodes[1].sample().loss_mask.any()
    with pytest.raises(ConfigError, match="each drives the episodes alone"):
        parse_config({"model": {"model_name_or_path": "m"}, "reward": {"agent": {"external": True, "path": "a.py:f"}}})

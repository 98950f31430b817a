"""Sync mode's step 1 (the rollout source, `coordinator/source.py`) with `train.dynamic_sampling`: groups whose samples all score the same never
reach the update, the batch is refilled from the next prompts of the data, the data position moves
past every batch drawn, and the drops are counted."""

import asyncio

import pytest
import torch

from rolefleet.actor.types import FinishReason, Sample, with_ids
from rolefleet.algos import informative_groups
from rolefleet.common.config import parse_config
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.saved_state import CoordinatorState
from rolefleet.coordinator.source import RolloutSource
from rolefleet.reward.types import ScoreResult


class ScriptedActor:
    """n samples per prompt; sample k's text is "<prompt>|k"."""

    def __init__(self):
        self.calls: list[list[str]] = []

    async def generate(self, prompts, sampling, first_group_id=0, continuations=None):
        self.calls.append(list(prompts))
        samples = [Sample(i, k, torch.tensor([1, 2]), torch.tensor([3 + k, 4]), torch.zeros(2), FinishReason.STOP, 0,
                          f"{p}|{k}") for i, p in enumerate(prompts) for k in range(sampling.n)]
        return with_ids(samples, first_group_id)


class ScriptedReward:
    """A prompt whose first character is in `varied` scores k % 2 for its sample k; any other 0."""

    def __init__(self, varied):
        self.varied, self.calls = set(varied), 0

    async def score(self, items):
        self.calls += 1
        total = torch.tensor([float(int(it.response.rpartition("|")[2]) % 2) if it.prompt[0] in self.varied else 0.0
                              for it in items])
        return ScoreResult(total, {"scripted": total.clone()}, [""] * len(items))


def setup(*overrides, varied="13579"):
    cfg = parse_config({"model": {"model_name_or_path": "m"}, "algorithm": "grpo",
                        "data": {"task": "addition", "size": 64},
                        "train": {"prompts_per_step": 6, "samples_per_prompt": 4,
                                  "dynamic_sampling": {"enabled": True}}}, list(overrides))
    dataset = PromptDataset.for_run(cfg)
    return cfg, dataset, ScriptedActor(), ScriptedReward(varied)


def sampler(cfg, actor, reward, dataset) -> RolloutSource:
    return RolloutSource(cfg, actor, reward, dataset, lambda: 0)


def test_all_equal_groups_are_dropped_and_the_batch_refilled():
    cfg, dataset, actor, reward = setup()
    state = CoordinatorState(step=0, kl_coef=0.0)
    rollout = asyncio.run(sampler(cfg, actor, reward, dataset).step(1, state))
    groups = torch.tensor([s.group_id for s in rollout.samples])
    assert informative_groups(rollout.reward.total, groups).all()  # no all-equal group reaches the update
    assert len(rollout.records) == 6 and len(rollout.samples) == 24
    assert [s.prompt_index for s in rollout.samples] == [i for i in range(6) for _ in range(4)]
    for s in rollout.samples:  # each sample's record is its own prompt's, renumbered
        assert s.response_text.startswith(rollout.records[s.prompt_index].prompt)
        assert rollout.records[s.prompt_index].prompt[0] in "13579"
    batches = len(actor.calls)
    assert batches > 1 and reward.calls == batches  # scored as they came, not asked for again
    assert state.counts.refill_batches == batches - 1
    drawn = [p for call in actor.calls for p in call]
    assert state.counts.dropped_groups == sum(p[0] not in "13579" for p in drawn) == rollout.stats["dynamic/dropped_groups"]
    assert rollout.stats["dynamic/kept_groups"] == 6 and rollout.stats["dynamic/batches"] == batches
    # The batches drawn are the data's next ones, in order; the next step starts after them.
    assert actor.calls == [[r.prompt for r in dataset.batch(i, 6)] for i in range(1, batches + 1)]
    state.step = 1  # the step body's, once the step's updates are applied
    assert state.batches_used == batches
    asyncio.run(sampler(cfg, actor, reward, dataset).step(2, state))
    assert actor.calls[batches] == [r.prompt for r in dataset.batch(batches + 1, 6)]


def test_past_its_bound_a_step_trains_on_what_it_kept():
    cfg, dataset, actor, reward = setup("train.dynamic_sampling.max_batches=1")
    rollout = asyncio.run(sampler(cfg, actor, reward, dataset).step(1, CoordinatorState(0, 0.0)))
    kept = sum(r.prompt[0] in "13579" for r in dataset.batch(1, 6))
    assert 0 < kept < 6 and len(rollout.records) == kept and rollout.stats["dynamic/kept_groups"] == kept


def test_with_no_signal_anywhere_the_last_batch_is_trained_whole():
    cfg, dataset, actor, reward = setup("train.dynamic_sampling.max_batches=2", varied="")
    state = CoordinatorState(0, 0.0)
    rollout = asyncio.run(sampler(cfg, actor, reward, dataset).step(1, state))
    assert [r.prompt for r in rollout.records] == [r.prompt for r in dataset.batch(2, 6)]
    assert rollout.stats["dynamic/kept_groups"] == 0 and state.counts.dropped_groups == 12


def test_the_overlong_penalty_is_what_the_filter_sees():
    """A group whose scores match but whose lengths differ inside the penalty's buffer differs once shaped."""
    cfg, dataset, actor, reward = setup("train.overlong.mode=penalty", "sampling.max_new_tokens=2",
                                        "train.overlong.buffer_tokens=1", varied="")
    actor.generate = lambda prompts, sampling, first_group_id=0: _ragged(prompts, sampling, first_group_id)
    rollout = asyncio.run(sampler(cfg, actor, reward, dataset).step(1, CoordinatorState(0, 0.0)))
    assert rollout.stats["dynamic/kept_groups"] == 6


async def _ragged(prompts, sampling, first_group_id):
    """Sample k of each prompt has 1 + k % 2 response tokens: half of them at the cap of 2."""
    return with_ids([Sample(i, k, torch.tensor([1]), torch.tensor([3] * (1 + k % 2)), torch.zeros(1 + k % 2),
                            FinishReason.LENGTH, 0, f"{p}|0") for i, p in enumerate(prompts) for k in range(sampling.n)],
                    first_group_id)


def test_without_dynamic_sampling_a_step_is_one_batch():
    cfg, dataset, actor, reward = setup("train.dynamic_sampling.enabled=false")
    rollout = asyncio.run(sampler(cfg, actor, reward, dataset).step(3, CoordinatorState(2, 0.0)))
    assert rollout.reward is None
    assert actor.calls == [[r.prompt for r in dataset.batch(3, 6)]] and reward.calls == 0


@pytest.mark.parametrize("overrides, message", [
    (["train.samples_per_prompt=1", "algorithm=ppo"], "samples_per_prompt >= 2"),
    (["train.overlong.mode=penalty", "sampling.max_new_tokens=8", "train.overlong.buffer_tokens=9"], "buffer_tokens=9"),
])
def test_settings_that_cannot_work_are_refused(overrides, message):
    from rolefleet.common.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        setup(*overrides)


def test_an_environments_rewards_count_in_what_the_filter_sees():
    """Multi-turn: the reward role scores every sample alike, the environment rewarded them
    differently; the groups keep their signal (the step's advantages see both)."""
    from rolefleet.reward.types import EnvOutcome

    class EnvReward(ScriptedReward):
        """Ends every conversation at its first turn, rewarding sample k with k % 2."""

        async def step(self, items):
            return [EnvOutcome([], done=True, reward=float(int(i.messages[-1]["content"].rpartition("|")[2]) % 2))
                    for i in items]

    cfg, dataset, actor, _ = setup("train.dynamic_sampling.max_batches=1", "actor.rollout.max_turns=2",
                                   "reward.env.name=tools", varied="")
    reward = EnvReward("")
    rollout = asyncio.run(sampler(cfg, actor, reward, dataset).step(1, CoordinatorState(0, 0.0)))
    assert rollout.stats["dynamic/kept_groups"] == 6
    assert [s.episode.env_reward for s in rollout.samples[:4]] == [0.0, 1.0, 0.0, 1.0]
    assert "env" not in rollout.reward.sources  # the step body adds the environment's rewards, once

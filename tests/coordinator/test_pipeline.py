"""The async pipeline (`pipeline.mode: async`) against in-process roles: the staleness bound, every
sample trained exactly once (also across a failed and retried call), backpressure, and sync mode
unchanged by it."""

import asyncio

import pytest
import torch

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.algos import informative_groups
from rolefleet.common.errors import Unavailable
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.pipeline import Pipeline
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import ScoreResult

pytestmark = pytest.mark.timeout(240)


class SlowReward(InProcessRewardClient):
    """The real reward core, `delay_s` slower per call; calls numbered in `fail` raise a transient
    error first (as a restarting server would)."""

    def __init__(self, core: RewardCore, delay_s: float = 0.0, fail: frozenset[int] = frozenset()):
        super().__init__(core)
        self.delay_s, self.fail, self.calls = delay_s, fail, 0

    async def score(self, items):
        self.calls += 1
        if self.calls in self.fail:
            raise Unavailable("reward server restarting")
        await asyncio.sleep(self.delay_s)
        return await super().score(items)


class CountingActor(InProcessActorClient):
    """Counts rollout batches generated but not yet trained on, as each new one starts."""

    def __init__(self, core: ActorCore):
        super().__init__(core)
        self.generated = self.updated = 0
        self.outstanding: list[int] = []

    async def generate_stream(self, prompts, sampling, first_group_id=0):
        self.outstanding.append(self.generated - self.updated)
        self.generated += 1
        async for chunk in super().generate_stream(prompts, sampling, first_group_id):
            yield chunk

    async def update(self, *args):
        result = await super().update(*args)
        self.updated += 1
        return result


def run(cfg, reward):
    actor = CountingActor(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound))
    critic = (InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound))
              if cfg.preset.uses_critic else None)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    status = RunStatus(cfg.run.name, cfg.train.total_steps)
    pipeline = Pipeline(cfg, Roles(actor, reward, critic), logger, status)
    asyncio.run(pipeline.run())
    logger.close()
    return pipeline, actor, logger.records


def recording(pipeline) -> list:
    """The rollouts the pipeline's steps train, in order, as they run."""
    trained, run_step = [], pipeline.body.run

    async def run(step, rollout, **kwargs):
        trained.append(rollout)
        return await run_step(step, rollout, **kwargs)

    pipeline.body.run = run
    return trained


def every_sample_once(cfg, pipeline):
    n, prompts = cfg.train.samples_per_prompt, cfg.train.prompts_per_step
    assert len(pipeline.trained) == len(set(pipeline.trained)) == cfg.train.total_steps * prompts * n


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_slow_reward_forces_lag_that_never_passes_the_bound(make_config, algorithm):
    cfg = make_config(f"algorithm={algorithm}", "pipeline.mode=async", "pipeline.max_staleness=1",
                      "train.total_steps=6", "train.samples_per_prompt=2")
    pipeline, _, records = run(cfg, SlowReward(RewardCore(cfg.reward), delay_s=0.3))
    lags = [r["pipeline/version_lag/max"] for r in records]
    assert max(lags) == 1 and all(0 <= lag <= 1 for lag in lags), lags  # generation ran ahead, never too far
    assert [r["policy_version"] for r in records] == list(range(1, 7))
    assert cfg.actor.is_correction == "token_truncate" and "actor/is_weight_mean" in records[-1]
    every_sample_once(cfg, pipeline)


def test_staleness_zero_trains_each_batch_on_the_policy_that_generated_it(make_config):
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=0", "train.total_steps=4",
                      "train.samples_per_prompt=2")
    pipeline, actor, records = run(cfg, SlowReward(RewardCore(cfg.reward), delay_s=0.1))
    assert all(r["pipeline/version_lag/max"] == 0 for r in records)
    assert actor.outstanding == [0, 0, 0, 0]  # the next batch only after the last one was trained on
    every_sample_once(cfg, pipeline)


def test_a_failed_call_is_retried_and_no_sample_is_lost_or_trained_twice(make_config):
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=5",
                      "train.samples_per_prompt=2")
    pipeline, _, records = run(cfg, SlowReward(RewardCore(cfg.reward), fail=frozenset({2, 3})))
    assert records[-1]["pipeline/retries"] == 2
    every_sample_once(cfg, pipeline)


def test_a_call_that_keeps_failing_ends_the_run_with_its_error(make_config):
    """A reward that stays away past reward.restart_wait_s (a trainer: past pipeline.retries)."""
    from rolefleet.common.errors import FailedPrecondition

    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "reward.restart_wait_s=1", "train.total_steps=3",
                      "train.samples_per_prompt=2")
    with pytest.raises(FailedPrecondition, match=r"reward role has not answered score for 1 s \(reward.restart_wait_s\)"):
        run(cfg, SlowReward(RewardCore(cfg.reward), fail=frozenset(range(2, 1000))))


def test_backpressure_keeps_the_actor_from_running_ahead_of_a_slow_reward(make_config):
    """A bound far above the queues: only backpressure holds generation back."""
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=100", "train.total_steps=8",
                      "train.samples_per_prompt=2", "pipeline.queue_capacity=2", "actor.is_correction=none")
    pipeline, actor, records = run(cfg, SlowReward(RewardCore(cfg.reward), delay_s=0.5))
    # At most: one waiting in each queue (a second one pauses generation), one being scored, one
    # being trained on, and the one starting.
    assert max(actor.outstanding) <= 4, actor.outstanding
    assert max(r["pipeline/queue/generated"] for r in records) <= 2
    every_sample_once(cfg, pipeline)


@pytest.mark.parametrize("on_stale", ["regenerate", "drop"])
def test_stale_batches_are_counted_then_regenerated_or_dropped(make_config, on_stale):
    """A batch that aged past the bound (forced here by lowering the bound after generation)."""
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=4",
                      "train.samples_per_prompt=2", f"pipeline.on_stale={on_stale}")
    actor = InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, 1))
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    pipeline = Pipeline(cfg, Roles(actor, SlowReward(RewardCore(cfg.reward), delay_s=0.2), None), logger,
                        RunStatus(cfg.run.name, cfg.train.total_steps))
    original = pipeline._fresh

    async def tightened(rollout):
        pipeline.p = cfg.pipeline.model_copy(update={"max_staleness": 0})  # lag 1 is now too old
        return await original(rollout)

    pipeline._fresh = tightened
    asyncio.run(pipeline.run())
    logger.close()
    last = logger.records[-1]
    assert last["pipeline/stale_samples"] > 0 and last["pipeline/version_lag/max"] == 0
    assert last["pipeline/regenerated_batches" if on_stale == "regenerate" else "pipeline/dropped_batches"] > 0
    assert [r["step"] for r in logger.records] == [1, 2, 3, 4]
    assert len(pipeline.trained) == len(set(pipeline.trained)) == 4 * 8 * 2


def test_async_mode_through_the_run_entry_point_finishes(make_config):
    cfg = make_config("algorithm=ppo", "pipeline.mode=async", "train.total_steps=3")
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)),
                  InProcessRewardClient(RewardCore(cfg.reward)), InProcessCriticClient(CriticCore(cfg.critic, 0, 1)))
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    status = asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, cfg.train.total_steps)))
    logger.close()
    assert status.state == RunState.FINISHED and status.step == 3
    assert [r["step"] for r in logger.records] == [1, 2, 3]


def test_the_reward_scores_chunks_of_samples_while_the_actor_still_generates(make_config):
    """Four engine calls per rollout batch (`actor.rollout.batch_size=4`): four Score calls, the
    first asked for before the batch's last chunk arrived."""
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=0", "train.total_steps=1",
                      "train.samples_per_prompt=2", "actor.rollout.batch_size=4")

    class Sized(SlowReward):
        sizes = []

        async def score(self, items):
            self.sizes.append(len(items))
            return await super().score(items)

    class Counted(CountingActor):
        yielded = 0  # chunks the stream has handed the coordinator so far

        async def generate_stream(self, prompts, sampling, first_group_id=0):
            async for chunk in super().generate_stream(prompts, sampling, first_group_id):
                Counted.yielded += 1
                yield chunk

    reward = Sized(RewardCore(cfg.reward))
    actor = Counted(ActorCore(cfg.actor, cfg.run.seed, 0))
    logger = RunLogger(cfg.run.out, 1, progress=False)
    pipeline = Pipeline(cfg, Roles(actor, reward, None), logger, RunStatus(cfg.run.name, 1))
    # When each chunk's scoring was asked for, in chunks received: when its task then runs is the
    # event loop's (on a loaded machine the stream can be read to its end first).
    asked_at, score_soon = [], pipeline._score_soon

    def recorded(records, samples):
        asked_at.append(Counted.yielded)
        return score_soon(records, samples)

    pipeline._score_soon = recorded
    asyncio.run(pipeline.run())
    logger.close()
    assert reward.sizes == [4, 4, 4, 4] and asked_at[0] < Counted.yielded
    every_sample_once(cfg, pipeline)


def test_async_runs_repeat_for_a_fixed_seed_whatever_the_timing(make_config):
    """Each batch lags by exactly the bound (the update waits for the batches that may precede it),
    so a slower reward changes nothing but the time."""
    rewards = []
    for delay in (0.0, 0.3):
        cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=4",
                          "train.samples_per_prompt=2")
        _, _, records = run(cfg, SlowReward(RewardCore(cfg.reward), delay_s=delay))
        rewards.append([(r["reward/mean"], r["actor/loss"], r["pipeline/version_lag/max"]) for r in records])
    assert rewards[0] == rewards[1]


def test_a_stop_request_ends_an_async_run_after_the_step_in_flight(make_config):
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=20",
                      "train.samples_per_prompt=2")
    status = RunStatus(cfg.run.name, cfg.train.total_steps)

    class StopAfterTwo(CountingActor):
        async def update(self, *args):
            result = await super().update(*args)
            if self.updated == 2:
                status.request_stop()
            return result

    roles = Roles(StopAfterTwo(ActorCore(cfg.actor, cfg.run.seed, 1)), InProcessRewardClient(RewardCore(cfg.reward)),
                  None)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    asyncio.run(train(cfg, roles, logger, status))
    logger.close()
    assert status.state == RunState.STOPPED and status.step == 2
    assert [r["step"] for r in logger.records] == [1, 2]


class SlowGeneration(CountingActor):
    """Generation `delay_s` slower; counts updates called while a generation is in flight."""

    def __init__(self, core: ActorCore, delay_s: float):
        super().__init__(core)
        self.delay_s, self.generating, self.overlapped = delay_s, 0, 0

    async def generate_stream(self, prompts, sampling, first_group_id=0):
        self.generating += 1
        try:
            await asyncio.sleep(self.delay_s)
            async for chunk in super().generate_stream(prompts, sampling, first_group_id):
                yield chunk
        finally:
            self.generating -= 1

    async def update(self, *args):
        self.overlapped += self.generating > 0
        return await super().update(*args)


@pytest.mark.parametrize("order", ["exact", "eager"])
def test_eager_order_updates_while_the_next_batch_generates_within_the_bound(make_config, order):
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=5",
                      "train.samples_per_prompt=2", f"pipeline.order={order}")
    actor = SlowGeneration(ActorCore(cfg.actor, cfg.run.seed, 1), delay_s=0.3)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    pipeline = Pipeline(cfg, Roles(actor, InProcessRewardClient(RewardCore(cfg.reward)), None), logger,
                        RunStatus(cfg.run.name, cfg.train.total_steps))
    asyncio.run(pipeline.run())
    logger.close()
    every_sample_once(cfg, pipeline)
    assert max(r["pipeline/version_lag/max"] for r in logger.records) <= 1
    # Exact order: an update waits for the batch the bound lets precede it, which is the only one
    # generation may start before the update; eager: the next batch generates during updates.
    assert (actor.overlapped > 0) == (order == "eager"), actor.overlapped


class ParityReward(SlowReward):
    """A prompt that starts with an odd digit scores its response's length modulo 2; any other 0:
    about half the groups all score the same, the rest mostly do not."""

    async def score(self, items):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        total = torch.tensor([float(len(it.response) % 2) if it.prompt[0] in "13579" else 0.0 for it in items])
        return ScoreResult(total, {"parity": total.clone()}, [""] * len(items))


@pytest.mark.parametrize("algorithm, staleness, delay", [("grpo", 1, 0.0), ("grpo", 0, 0.0), ("ppo", 1, 0.2)])
def test_dynamic_sampling_in_async_mode_trains_only_informative_groups_and_refills(make_config, algorithm,
                                                                                   staleness, delay):
    """Each batch a step draws beyond its first is counted before it is awaited, so generation
    (held by the bound, or at the run's end) starts it; with a critic, the joined batch's values are
    asked for again. The lag bound holds; no sample is trained twice."""
    cfg = make_config(f"algorithm={algorithm}", "pipeline.mode=async", f"pipeline.max_staleness={staleness}",
                      "train.total_steps=3", "train.samples_per_prompt=4", "train.dynamic_sampling.enabled=true",
                      "train.dynamic_sampling.max_batches=6")
    actor = CountingActor(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound))
    critic = InProcessCriticClient(CriticCore(cfg.critic, 0, staleness)) if algorithm == "ppo" else None
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    pipeline = Pipeline(cfg, Roles(actor, ParityReward(RewardCore(cfg.reward), delay_s=delay), critic), logger,
                        RunStatus(cfg.run.name, cfg.train.total_steps))
    trained = recording(pipeline)
    asyncio.run(pipeline.run())
    logger.close()
    records = logger.records
    assert [r["step"] for r in records] == [1, 2, 3]
    for rollout, record in zip(trained, records):
        groups = torch.tensor([s.group_id for s in rollout.samples])
        assert informative_groups(rollout.reward.total, groups).all()  # no all-equal group reaches the update
        assert len(rollout.records) == record["dynamic/kept_groups"] == 8
        assert all(rollout.records[s.prompt_index].prompt[0] in "13579" for s in rollout.samples)
    drawn = sum(r["dynamic/batches"] for r in records)
    assert drawn > 3 and records[-1]["pipeline/refill_batches"] == drawn - 3
    assert records[-1]["pipeline/dropped_groups"] == sum(r["dynamic/dropped_groups"] for r in records) > 0
    assert pipeline.state.batches_used == drawn and actor.generated >= drawn
    assert all(r["pipeline/version_lag/max"] <= staleness for r in records)
    assert len(pipeline.trained) == len(set(pipeline.trained)) == 3 * 8 * 4


def test_async_dynamic_sampling_repeats_for_a_fixed_seed_whatever_the_timing(make_config):
    """The refills a step counts move the generate stage's look-ahead with them, so under the
    exact order each batch still lags by what the bound gives, whatever the reward's speed."""
    runs = []
    for delay in (0.0, 0.3):
        cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=3",
                          "train.samples_per_prompt=4", "train.dynamic_sampling.enabled=true")
        _, _, records = run(cfg, ParityReward(RewardCore(cfg.reward), delay_s=delay))
        runs.append([(r["reward/mean"], r["actor/loss"], r["pipeline/version_lag/max"], r["dynamic/batches"])
                     for r in records])
    assert runs[0] == runs[1]

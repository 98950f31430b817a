import asyncio
import math
import time

import pytest
import torch

from rolefleet.common.errors import InvalidArgument, Unavailable
from rolefleet.common.role_types import RoleStatus
from rolefleet.reward.replicas import ReplicatedRewardClient
from rolefleet.reward.types import ScoreItem, ScoreResult


class FakeReplica:
    """Scores item k as k (its prompt); `delay` seconds per call; `down`: raises Unavailable."""

    def __init__(self, name: str, delay: float = 0.0, down: bool = False, error: Exception | None = None):
        self.name, self.delay, self.down, self.error = name, delay, down, error
        self.shards: list[list[int]] = []
        self.cancelled = self.closed = 0

    async def score(self, items):
        self.shards.append([int(i.prompt) for i in items])
        if self.down:
            raise Unavailable(f"{self.name} is down")
        if self.error:
            raise self.error
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        values = torch.tensor([float(i.prompt) for i in items])
        return ScoreResult(values, {"rule": values * 2, self.name: values * 3}, [f"{self.name}:{i.prompt}" for i in items])

    async def status(self, include_digest=False):
        if self.down:
            raise Unavailable(f"{self.name} is down")
        return RoleStatus("reward", instance_id=self.name)

    async def close(self):
        self.closed += 1


def batch(n: int) -> list[ScoreItem]:
    return [ScoreItem(str(k), "r", "t") for k in range(n)]


def run(coro):
    return asyncio.run(coro)


def test_both_replicas_get_contiguous_shards_merged_in_item_order():
    a, b = FakeReplica("a"), FakeReplica("b")
    client = ReplicatedRewardClient([a, b])
    result = run(client.score(batch(10)))
    assert isinstance(result, ScoreResult) and result.check(10) is result
    assert client.calls == {0: 1, 1: 1}
    assert sorted([*a.shards, *b.shards]) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert result.total.tolist() == list(range(10))
    assert result.sources["rule"].tolist() == [2.0 * k for k in range(10)]
    # A source only one shard reported is NaN for the other shard's items (as a failed source is).
    first, second = ("a", "b") if a.shards[0][0] == 0 else ("b", "a")
    assert result.sources[first][:5].tolist() == [3.0 * k for k in range(5)]
    assert all(math.isnan(v) for v in result.sources[first][5:].tolist())
    assert result.errors == [f"{first}:{k}" for k in range(5)] + [f"{second}:{k}" for k in range(5, 10)]


def test_shards_follow_weights_and_small_batches_use_fewer_replicas():
    a, b = FakeReplica("a"), FakeReplica("b")
    client = ReplicatedRewardClient([a, b], weights=[3, 1], min_shard_items=4)
    assert run(client.score(batch(8))).total.tolist() == list(range(8))
    assert sorted(len(s) for s in [*a.shards, *b.shards]) == [2, 6]
    run(client.score(batch(5)))  # under 2 x min_shard_items: one replica
    assert sum(client.calls.values()) == 3
    old = ReplicatedRewardClient([FakeReplica("x"), FakeReplica("y")])  # older clients answer tensors

    class TensorReplica(FakeReplica):
        async def score(self, items):
            return (await super().score(items)).total

    old.clients = [TensorReplica("x"), TensorReplica("y")]
    assert run(old.score(batch(6))).tolist() == list(range(6))


def test_a_replica_that_is_down_has_its_shard_rescored_and_sits_out_a_cooldown():
    up, down = FakeReplica("up"), FakeReplica("down", down=True)
    now = [100.0]  # the client's clock: the cooldown is not at the mercy of a loaded machine
    client = ReplicatedRewardClient([up, down], cooldown_s=0.3, clock=lambda: now[0])
    assert run(client.score(batch(10))).total.tolist() == list(range(10))
    assert client.failures == {0: 0, 1: 1}
    assert sorted(k for shard in up.shards for k in shard) == list(range(10))
    assert run(client.score(batch(10))).total.tolist() == list(range(10))
    assert client.calls[1] == 1 and up.shards[-1] == list(range(10))  # skipped while cooling down
    now[0] += 0.35
    down.down = False
    run(client.score(batch(10)))
    assert client.calls[1] == 2 and down.shards[-1] in ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])


def test_a_slow_replica_is_hedged_and_the_first_answer_wins():
    fast, slow = FakeReplica("fast", delay=0.01), FakeReplica("slow", delay=5.0)
    # Adaptive delay: 2 x the fast shard's time, at least 50 ms, learned within this first batch.
    client = ReplicatedRewardClient([fast, slow], min_hedge_s=0.05)
    start = time.monotonic()
    result = run(client.score(batch(8)))
    assert time.monotonic() - start < 4.0  # not the slow replica's 5 s
    assert result.total.tolist() == list(range(8))
    assert client.hedges == 1 and slow.cancelled == 1 and client.lost_hedges == {0: 0, 1: 1}
    assert client.calls == {0: 2, 1: 1}


def test_a_fixed_hedge_delay_is_used_when_given():
    fast, slow = FakeReplica("fast", delay=0.01), FakeReplica("slow", delay=5.0)
    client = ReplicatedRewardClient([slow, fast], hedge_after_s=0.2, min_shard_items=10)
    start = time.monotonic()
    assert run(client.score(batch(4))).total.tolist() == list(range(4))  # one shard, sent to `slow`
    assert 0.2 <= time.monotonic() - start < 4.0  # not the slow replica's 5 s
    assert slow.cancelled == 1 and client.hedges == 1


def test_a_hedge_that_loses_to_its_primary_does_not_cool_its_replica():
    primary, late = FakeReplica("primary", delay=0.3), FakeReplica("late", delay=1.0)
    client = ReplicatedRewardClient([primary, late], hedge_after_s=0.1, min_shard_items=10)
    assert run(client.score(batch(4))).total.tolist() == list(range(4))
    assert client.hedges == 1 and late.cancelled == 1 and client.lost_hedges == {0: 0, 1: 0}
    primary.delay = late.delay = 0.0
    run(client.score(batch(20)))  # both replicas still take shards
    assert client.calls == {0: 2, 1: 2}


def test_all_replicas_down_raises_unavailable_naming_each():
    client = ReplicatedRewardClient([FakeReplica("a", down=True), FakeReplica("b", down=True)])
    with pytest.raises(Unavailable, match=r"all 2 reward replicas tried failed.*replica \d: Unavailable: [ab] is down; "
                                          r"replica \d: Unavailable: [ab] is down"):
        run(client.score(batch(4)))
    with pytest.raises(Unavailable, match="no reward replica answered"):
        run(client.status())


def test_a_bad_request_is_not_retried_elsewhere():
    bad = FakeReplica("bad", error=InvalidArgument("items[0]", "too long"))
    good = FakeReplica("good", delay=0.5)
    client = ReplicatedRewardClient([bad, good], min_shard_items=10)
    with pytest.raises(InvalidArgument, match=r"items\[0\]"):
        run(client.score(batch(4)))
    assert client.calls == {0: 1, 1: 0} and client.failures == {0: 0, 1: 0}


def test_status_asks_the_first_healthy_replica_and_close_closes_all():
    a, b = FakeReplica("a", down=True), FakeReplica("b")
    client = ReplicatedRewardClient([a, b])
    assert run(client.status()).instance_id == "b"
    assert client.failures[0] == 1
    run(client.close())
    assert a.closed == b.closed == 1


def test_a_replica_added_mid_run_gets_shards_and_a_retired_one_finishes_its_calls_then_closes():
    a, b, c = FakeReplica("a", delay=0.3), FakeReplica("b"), FakeReplica("c")
    client = ReplicatedRewardClient([a], labels=["a:1"])

    async def scenario():
        client.add(b, "b:1")
        assert (await client.score(batch(10))).total.tolist() == list(range(10))
        assert a.shards and b.shards  # the new replica got its share at once
        in_flight = asyncio.ensure_future(client.score(batch(10)))
        await asyncio.sleep(0.05)  # a is scoring its shard
        client.retire("a:1")
        assert client.active_labels() == ["b:1"] and a.closed == 0  # still busy
        assert (await in_flight).total.tolist() == list(range(10))  # nothing lost
        await asyncio.sleep(0.2)
        assert a.closed == 1 and a.cancelled == 0
        served = len(a.shards)
        client.add(c, "c:1")
        for _ in range(3):
            await client.score(batch(10))
        assert len(a.shards) == served and c.shards  # the retired replica gets no new work
        with pytest.raises(ValueError, match="already in use"):
            client.add(c, "c:1")
        with pytest.raises(KeyError, match="no reward replica a:1 in use"):
            client.retire("a:1")
        client.retire("b:1")
        with pytest.raises(ValueError, match="the last one in use"):
            client.retire("c:1")

    run(scenario())


class FakeEnvReplica(FakeReplica):
    """Answers each conversation with its prompt as the observation."""

    async def step(self, items):
        self.shards.append([int(i.prompt) for i in items])
        if self.down:
            raise Unavailable(f"{self.name} is down")
        from rolefleet.reward.types import EnvOutcome
        return [EnvOutcome([{"role": "tool", "content": f"{self.name}:{i.prompt}"}], done=False) for i in items]


@pytest.mark.multiturn
def test_environment_steps_spread_over_replicas_and_move_off_a_failed_one():
    from rolefleet.reward.types import EnvItem

    a, b = FakeEnvReplica("a"), FakeEnvReplica("b", down=True)
    client = ReplicatedRewardClient([a, b], min_shard_items=1)
    items = [EnvItem(str(k), "t", [{"role": "assistant", "content": "x"}]) for k in range(6)]
    outcomes = run(client.step(items))
    # In item order, every one answered by the live replica (b's share moved to a).
    assert [o.observation[0]["content"] for o in outcomes] == [f"a:{k}" for k in range(6)]
    assert client.failures[1] == 1
    b.down = a.down = True
    with pytest.raises(Unavailable, match="no reward replica answered Step"):
        run(client.step(items))

"""A reward client over several reward replicas: each batch is split into contiguous shards scored
concurrently, and a shard whose replica fails or lags is re-sent to another one (a hedged request:
the first answer wins, the other call is cancelled).

Only the client interface is used (`score`, `status`, `close`), so replicas may be gRPC or
in-process clients; like the other clients this module imports no model library.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rolefleet.common.errors import Unavailable
from rolefleet.common.role_types import RoleStatus
from rolefleet.reward.types import ScoreItem, ScoreResult

log = logging.getLogger(__name__)

# What another replica may answer: the replica is down, restarting or overloaded. Anything else
# (a bad item, a limit) would fail the same way everywhere, so it propagates at once.
TRANSIENT = (Unavailable, TimeoutError, ConnectionError)


class ReplicatedRewardClient:
    """`score`, `status` and `close` of one reward client, spread over `clients`.

    hedge_after_s: re-send a shard to another replica when it has not answered after this many
        seconds; None: `hedge_factor` x the median of recent shard times, at least `min_hedge_s`
        (`initial_hedge_s` before any shard has finished).
    cooldown_s: a replica that failed, or lost a hedge, gets no new shards for this long (it is still
        tried as a last resort when every other replica has failed).
    min_shard_items: a batch is cut into at most len(items) / min_shard_items shards, so small
        batches use fewer replicas.
    weights: relative capacity of each replica (e.g. its GPU count); shards are proportional to it.
    labels: a name per replica (its address) for `add` and `retire`.

    Replicas can be added and retired while calls run (scaling a running run): a retired replica
    gets no new shard, finishes the calls it has (a shard it then fails goes to another replica, as
    any failure does), and is closed once idle.
    """

    def __init__(self, clients: Sequence[Any], hedge_after_s: float | None = None, hedge_factor: float = 2.0,
                 min_hedge_s: float = 0.5, initial_hedge_s: float = 30.0, cooldown_s: float = 10.0,
                 min_shard_items: int = 1, weights: Sequence[float] | None = None,
                 clock: Callable[[], float] = time.monotonic, labels: Sequence[str] | None = None):
        if not clients:
            raise ValueError("ReplicatedRewardClient needs at least one reward client")
        if weights is not None and (len(weights) != len(clients) or min(weights) <= 0):
            raise ValueError(f"weights: one positive number per replica ({len(clients)}), got {list(weights)}")
        self.clients = list(clients)
        self.labels = list(labels) if labels is not None else [f"replica {i}" for i in range(len(clients))]
        self.retired: set[int] = set()
        self.hedge_after_s, self.hedge_factor = hedge_after_s, hedge_factor
        self.min_hedge_s, self.initial_hedge_s = min_hedge_s, initial_hedge_s
        self.cooldown_s, self.min_shard_items = cooldown_s, max(1, min_shard_items)
        self.weights = list(weights) if weights is not None else [1.0] * len(clients)
        self.clock = clock
        n = len(self.clients)
        self.calls = dict.fromkeys(range(n), 0)  # score calls sent to each replica (hedges included)
        self.failures = dict.fromkeys(range(n), 0)  # transient errors per replica
        self.hedges = 0  # shards re-sent because their replica lagged
        self.lost_hedges = dict.fromkeys(range(n), 0)  # calls a later hedge beat, per replica
        self._down_until = dict.fromkeys(range(n), float("-inf"))
        self._versions: dict[int, str] = {}  # replica -> its reward version, asked once (again after a failure)
        self._in_flight = dict.fromkeys(range(n), 0)
        self._shard_times: deque[float] = deque(maxlen=64)
        self._timing: asyncio.Future | None = None  # resolved when a shard time is recorded
        self._next = 0  # rotates the first replica, so one-shard batches do not all land on replica 0

    # --- the RewardClient interface ------------------------------------------------------------------

    async def score(self, items: list[ScoreItem]):
        """The replicas' answer for `items` (a ScoreResult, or a tensor from an older client), merged
        in item order."""
        bounds = self._shards(len(items))
        tasks = [asyncio.ensure_future(self._score_shard(items[a:b], first, (a, b))) for a, b, first in bounds]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one shard failed: the others' answers are of no use
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return results[0] if len(results) == 1 else merge(results)

    async def step(self, items: list):
        """The environment's answers (`RewardClient.step`), the items spread over the replicas like a
        Score's; a shard whose replica fails transiently goes to the next one (no hedging: an
        environment's turn may run tools, which are not worth running twice)."""
        return await self._spread(items, lambda client, part: client.step(part), "Step")

    async def run_agents(self, items: list):
        """The agents' episodes (`RewardClient.run_agents`), spread as `step`'s."""
        return await self._spread(items, lambda client, part: client.run_agents(part), "RunAgents")

    async def _spread(self, items: list, method, name: str) -> list:
        async def shard(part: list, first: int) -> list:
            reasons = []
            for index in [first, *(i for i in self._by_preference(self._live()) if i != first)]:
                try:
                    self.calls[index] += 1
                    return await method(self.clients[index], part)
                except TRANSIENT as exc:
                    self._mark_down(index, exc)
                    reasons.append(f"replica {index}: {exc}")
            raise Unavailable(f"no reward replica answered {name} ({'; '.join(reasons)})")

        parts = await asyncio.gather(*(shard(items[a:b], first) for a, b, first in self._shards(len(items))))
        return [outcome for part in parts for outcome in part]

    async def status(self, include_digest: bool = False) -> RoleStatus:
        """The status of the first replica that answers, healthy ones first."""
        reasons = []
        for index in self._by_preference(self._live()):
            try:
                return await self.clients[index].status(include_digest)
            except TRANSIENT as exc:
                self._mark_down(index, exc)
                reasons.append(f"replica {index}: {exc}")
        raise Unavailable(f"no reward replica answered GetStatus ({'; '.join(reasons)})")

    async def versions(self) -> dict[str, str]:
        """Each replica in use's reward version (its definition's digest, `reward/definition.py`),
        by label: asked once per replica, and again after it failed a call (a restarted replica may
        serve another definition); one that does not answer now is left out."""
        unknown = [i for i in self._live() if i not in self._versions]
        answers = await asyncio.gather(*(self.clients[i].status() for i in unknown), return_exceptions=True)
        self._versions.update({i: a.weights_digest for i, a in zip(unknown, answers)
                               if not isinstance(a, BaseException)})
        return {self.labels[i]: self._versions[i] for i in self._live() if i in self._versions}

    async def close(self) -> None:
        live = [self.clients[i] for i in self._live()]  # retired ones close themselves
        results = await asyncio.gather(*(c.close() for c in live), return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, Exception):
                log.warning("closing reward replica %d: %s", index, result)

    # --- scaling -------------------------------------------------------------------------------------

    def add(self, client: Any, label: str, weight: float = 1.0) -> None:
        """A new replica; the next batches' shards include it."""
        if label in self.active_labels():
            raise ValueError(f"reward replica {label} is already in use")
        index = len(self.clients)
        self.clients.append(client)
        self.labels.append(label)
        self.weights.append(weight)
        for counter in (self.calls, self.failures, self.lost_hedges, self._in_flight):
            counter[index] = 0
        self._down_until[index] = float("-inf")
        log.info("reward replica %s added (%d in use)", label, len(self._live()))

    def retire(self, label: str) -> None:
        """No new shard for replica `label`; its calls in flight finish, then it is closed."""
        index = next((i for i in self._live() if self.labels[i] == label), None)
        if index is None:
            raise KeyError(f"no reward replica {label} in use (in use: {', '.join(self.active_labels())})")
        if len(self._live()) == 1:
            raise ValueError(f"reward replica {label} is the last one in use: add another first")
        self.retired.add(index)
        log.info("reward replica %s retired (%d calls in flight; %d in use)", label, self._in_flight[index],
                 len(self._live()))
        asyncio.ensure_future(self._close_when_idle(index))  # noqa: RUF006 - it ends by itself

    def active_labels(self) -> list[str]:
        return [self.labels[i] for i in self._live()]

    async def _close_when_idle(self, index: int) -> None:
        while self._in_flight[index] > 0:
            await asyncio.sleep(0.1)
        await self.clients[index].close()

    def _live(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.retired]

    # --- sharding ------------------------------------------------------------------------------------

    def _healthy(self) -> list[int]:
        now = self.clock()
        return [i for i in self._live() if self._down_until[i] <= now]

    def _by_preference(self, indices) -> list[int]:
        """Healthy replicas (least loaded first), then those cooling down (soonest back first)."""
        now = self.clock()
        return sorted(indices, key=lambda i: (self._down_until[i] > now, self._down_until[i], self._in_flight[i]))

    def _shards(self, n: int) -> list[tuple[int, int, int]]:
        """(start, end, replica) of contiguous shards, sized in proportion to the replicas' weights."""
        healthy = self._healthy() or self._by_preference(self._live())[:1]
        start = self._next % len(healthy)
        self._next += 1
        count = max(1, min(len(healthy), n // self.min_shard_items))
        chosen = (healthy[start:] + healthy[:start])[:count]
        total = sum(self.weights[i] for i in chosen)
        bounds, acc = [], 0.0
        for k, index in enumerate(chosen):
            acc += self.weights[index]
            end = n if k == count - 1 else round(n * acc / total)
            begin = bounds[-1][1] if bounds else 0
            if end > begin or n == 0:
                bounds.append((begin, end, index))
        return bounds

    # --- one shard: primary, hedges and retries ------------------------------------------------------

    def hedge_delay(self) -> float:
        if self.hedge_after_s is not None:
            return self.hedge_after_s
        if not self._shard_times:
            return self.initial_hedge_s
        return max(self.min_hedge_s, self.hedge_factor * statistics.median(self._shard_times))

    async def _score_shard(self, items: list[ScoreItem], first: int, span: tuple[int, int]):
        attempts: dict[asyncio.Future, tuple[int, float]] = {}  # call -> (replica, start time)
        tried: set[int] = set()
        reasons: list[str] = []
        self._launch(attempts, tried, items, first)
        try:
            while True:
                spare = [i for i in self._healthy() if i not in tried]
                last_start = max(start for _, start in attempts.values())
                timeout = max(0.0, last_start + self.hedge_delay() - self.clock()) if spare else None
                # A sibling shard's time can shorten the hedge delay (the first batch has none yet).
                timing = self._timing_future()
                done, _ = await asyncio.wait([*attempts, timing], timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                for call in done - {timing}:
                    index, start = attempts.pop(call)
                    self._in_flight[index] -= 1
                    if (exc := call.exception()) is None:
                        self._record(self.clock() - start)
                        self._cool_losers(attempts, start)
                        return call.result()
                    if not isinstance(exc, TRANSIENT):
                        raise exc
                    self._mark_down(index, exc)
                    reasons.append(f"replica {index}: {type(exc).__name__}: {exc}")
                if not done and spare:  # the hedge delay passed with no answer
                    self.hedges += 1
                    log.info("reward shard %s: no answer from replica(s) %s after %.2fs, hedging", span,
                             sorted(i for i, _ in attempts.values()), self.hedge_delay())
                    self._launch(attempts, tried, items, self._by_preference(spare)[0])
                elif not attempts:  # every call so far failed: try a replica not tried yet, any state
                    untried = [i for i in self._live() if i not in tried]
                    if not untried:
                        raise Unavailable(f"all {len(tried)} reward replicas tried failed to score items "
                                          f"[{span[0]}, {span[1]}): {'; '.join(reasons)}")
                    self._launch(attempts, tried, items, self._by_preference(untried)[0])
        finally:
            for call, (index, _) in attempts.items():
                if call.done() and not call.cancelled():
                    call.exception()  # retrieved: a late error of a lost race is not worth a warning
                call.cancel()
                self._in_flight[index] -= 1

    def _launch(self, attempts: dict, tried: set[int], items: list[ScoreItem], index: int) -> None:
        tried.add(index)
        self.calls[index] += 1
        self._in_flight[index] += 1
        attempts[asyncio.ensure_future(self.clients[index].score(items))] = (index, self.clock())

    def _timing_future(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if self._timing is None or self._timing.get_loop() is not loop:  # one per loop: clients outlive loops in tests
            self._timing = loop.create_future()
        return self._timing

    def _record(self, seconds: float) -> None:
        self._shard_times.append(seconds)
        timing = self._timing
        if timing is not None and not timing.done() and timing.get_loop() is asyncio.get_running_loop():
            timing.set_result(None)
        self._timing = None

    def _mark_down(self, index: int, exc: BaseException) -> None:
        self.failures[index] += 1
        self._versions.pop(index, None)
        self._down_until[index] = self.clock() + self.cooldown_s
        log.warning("reward replica %d failed (%s: %s); skipped for %.0fs", index, type(exc).__name__, exc,
                    self.cooldown_s)

    def _cool_losers(self, attempts: dict, winner_start: float) -> None:
        """Calls started before the winner and still running lost a hedge: their replicas are slower
        on the same items, so they sit out a cool-down too. (A hedge that merely started later and
        lost to its primary says nothing about its replica.)"""
        for index, start in attempts.values():
            if start < winner_start:
                self.lost_hedges[index] += 1
                self._down_until[index] = self.clock() + self.cooldown_s


def merge(results: list) -> Any:
    """Shard answers -> one answer in item order (ScoreResult.concat; bare score tensors concatenated)."""
    if isinstance(results[0], torch.Tensor):
        return torch.cat(results)
    return ScoreResult.concat(results)

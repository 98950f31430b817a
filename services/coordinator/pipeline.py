"""The asynchronous pipeline (`pipeline.mode: async`): the phases of DESIGN "One step" as three
stages that run at once, joined by bounded queues.

    generate ──[generated]──► score ──[scored]──► train

1. generate: the next rollout batch from the policy the actor holds, once it may still be trained
   in time (the batch for step k is trained at actor version k - 1, so it waits until
   k - 1 - version <= max_staleness) and while no queue downstream is filled past
   `backpressure_threshold`.
   Samples stream from the actor as they finish; each chunk of them (`actor.rollout.batch_size`
   samples, one engine call's worth) goes to reward.Score and critic.ComputeValues at once, while
   the actor generates on.
2. score: the batch's scores and values, chunk by chunk (most of them in already), while the actor
   generates the next batch or trains on the previous one; for a one-pass update
   (`RoleFleetConfig.one_pass_update`) the reference's logprobs too, which no update changes.
3. train, in order: the batch's lag is checked (a batch past the bound is counted and generated
   again or dropped, `pipeline.on_stale`); with `train.dynamic_sampling`, the groups whose samples
   all scored the same are dropped and further scored batches taken until the step has its groups
   (`dynamic.KeptGroups`, as in sync mode); then the step body both modes run (`step.py`):
   actor.ComputeLogProbs with the current policy (the proximal policy: the PPO ratio starts at 1,
   and the rollout policy's lag is corrected by `actor.is_correction`), unless the update is one
   pass (its own forward computes them: the policy's pass that waits for the update before is
   gone); advantages; actor.Update | critic.Update, once the batches the bound lets precede this
   update have been generated (`pipeline.order: exact`: each batch lags by exactly the bound,
   whatever the timing, so runs repeat for a fixed seed; `eager`: at once, so that a split actor
   trains while it generates, each batch lagging by what the timing gives, within the bound); the
   step's record; a checkpoint when due.

A transient failure (UNAVAILABLE, a deadline) of a role call is retried `pipeline.retries` times,
as in sync mode (`calls.Retries`); a failed stream is generated again from its start (seeded: the
same samples) and its chunks' scoring with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from rolefleet.actor.types import Sample
from rolefleet.common import metrics
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import Unavailable
from rolefleet.common.role_types import UpdateResult
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.calls import Roles
from rolefleet.coordinator.checkpoints import Checkpointer
from rolefleet.coordinator.dynamic import KeptGroups
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.rollout import Rollout, score_items, spent, to_batch
from rolefleet.coordinator.saved_state import CoordinatorState
from rolefleet.coordinator.state import RunStatus
from rolefleet.coordinator.step import Schedule, StepBody
from rolefleet.critic.types import CriticValues
from rolefleet.reward.types import ScoreResult
from rolefleet.tasks import PromptRecord

log = logging.getLogger(__name__)
STAGES = ("generate", "score", "train")


class Pipeline(Schedule):
    def __init__(self, cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus,
                 clock: BusyClock | None = None, checkpointer: Checkpointer | None = None,
                 resumed: CoordinatorState | None = None):
        if clock is None:  # run directly, not through `loop.train`: time the roles here
            clock = BusyClock()
            roles = clock.track(roles)
        self.body = StepBody(cfg, roles, logger, status, clock, checkpointer or Checkpointer(cfg), resumed)
        self.cfg, self.status, self.clock, self.p = cfg, status, clock, cfg.pipeline
        self.roles, self.state, self.dataset = self.body.roles, self.body.state, self.body.dataset
        self.generated: asyncio.Queue[Rollout] = asyncio.Queue(self.p.queue_capacity)
        self.scored: asyncio.Queue[Rollout] = asyncio.Queue(self.p.queue_capacity)
        # Resumed after checkpoint k: batches after it are generated again (from the loaded policy,
        # so lags may differ from the interrupted run's).
        self.version = self.state.step  # the actor's policy version: updates applied this run
        self.generated_batches = self.state.batches_used  # batches the generate stage finished
        self.changed = asyncio.Condition()  # the version moved or a queue drained
        self.busy = dict.fromkeys(STAGES, 0.0)
        self.trained: list[int] = []  # sample ids in the order they were trained on
        self.start = self.last = self.train_start = time.perf_counter()
        # The pipeline's series exist from its start (at 0), not from the first stale sample.
        metrics.PIPELINE_STALE_SAMPLES.labels("coordinator")
        self._depths()

    async def run(self) -> None:
        """Until the train stage has trained `total_steps` batches (or a stop); a stage that fails
        ends the run with its error."""
        await self.body.evaluate_start()  # the starting policy, before any batch
        stages = [asyncio.create_task(stage(), name=f"pipeline-{stage.__name__}")
                  for stage in (self._generate_stage, self._score_stage, self._train_stage)]
        done, pending = await asyncio.wait(stages, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()

    # --- the stages --------------------------------------------------------------------------------

    async def _generate_stage(self) -> None:
        index = self.generated_batches
        while True:
            index += 1
            await self.status.wait_resumed()  # paused: no new batch starts
            if (held := self._held_by(index)) is not None:
                await self._wait(lambda i=index: self._may_generate(i), f"generate waits ({held})")
            rollout = await self._rollout(index)
            async with self.changed:
                self.generated_batches += 1
                self.changed.notify_all()
            await self.generated.put(rollout)
            self._depths()

    async def _score_stage(self) -> None:
        while True:
            rollout = await self.generated.get()
            await self._notify()  # a queue drained: generation may resume
            await self._score(rollout)
            await self.scored.put(rollout)
            self._depths()

    async def _train_stage(self) -> None:
        self.last = time.perf_counter()
        while self.state.step < self.cfg.train.total_steps:
            await self.status.wait_resumed()  # paused: no update starts
            if self.status.stop_requested:
                break
            step = self.state.step + 1
            rollout = await (self._kept_groups(step) if self.cfg.train.dynamic_sampling.enabled else self._next_batch())
            if rollout is None:  # dropped past the bound; the step trains on the next batch
                continue
            self.train_start = time.perf_counter()
            await self.body.run(step, rollout, since=self.last, schedule=self)
        await self.body.finish()

    async def _next_batch(self) -> Rollout | None:
        """The next scored batch within the bound (None: it was dropped)."""
        with self.clock.span("train waits (scored batch)") if self.scored.empty() else contextlib.nullcontext():
            rollout = await self.scored.get()
        await self._notify()
        return await self._fresh(rollout)

    async def _kept_groups(self, step: int) -> Rollout:
        """`train.dynamic_sampling`: the informative groups of as many scored batches as the step
        takes (`KeptGroups`). Each batch beyond the first is counted as the step's before it is
        waited for, which lets the generate stage start it (its staleness and end-of-run checks
        count batches per step)."""
        # Groups that ended with carried episodes cannot wait for a later step: none is trimmed.
        kept = KeptGroups(self.cfg, trim=not self.body.source.carrying)
        while True:
            rollout = await self._next_batch()
            if rollout is None:  # dropped past the bound: its replacement is counted already
                continue
            kept.add(rollout, rollout.reward, rollout.score_s)
            if kept.done:
                joined = kept.rollout(step, self.state.counts)
                joined.stats.update(self.body.source.joined_stats(joined, [b for b, _, _ in kept.kept], step))
                return joined
            async with self.changed:
                self.state.counts.refill_batches += 1
                self.changed.notify_all()

    # --- around the step body's updates (`Schedule`) -------------------------------------------------

    async def before_update(self, step: int) -> None:
        if self.p.order == "exact":
            # Every batch that may be generated from the policy before this update is, first:
            # each batch then lags by exactly what the bound allows, whatever the timing (runs
            # repeat for a fixed seed). Backed-up queues let the update go first (generation
            # waits on them). Eager order skips this: the update overlaps the next generation.
            ahead = min(step + self.p.max_staleness, self.cfg.train.total_steps) + self.state.extra_batches
            await self._wait(lambda n=ahead: self.generated_batches >= n or self._backed_up(),
                             "update waits (exact order)")

    async def updated(self, rollout: Rollout, actor: UpdateResult, now: float,
                      seconds: dict[str, float]) -> dict[str, float]:
        lag = torch.tensor([self.version - smp.policy_version for smp in rollout.samples], dtype=torch.float32)
        self.trained += [smp.sample_id for smp in rollout.samples]
        async with self.changed:
            self.version = actor.model_version
            self.changed.notify_all()
        self.busy["train"] += now - self.train_start
        metrics.STAGE_SECONDS.labels("coordinator", "train").inc(now - self.train_start)
        self.last = now  # the next step's time runs from here
        return self._pipeline_stats(lag, now)

    # --- stage work --------------------------------------------------------------------------------

    async def _rollout(self, index: int) -> Rollout:
        """Batch `index` from the rollout source, each chunk of finished samples sent to the reward
        (and the critic) as it ends, while the actor generates on; a transient failure restarts the
        batch (generation is seeded, and the source changes nothing on a failed attempt: the same
        samples)."""
        chunk = min(self.cfg.actor.rollout.batch_size, self.cfg.train.prompts_per_step * self.cfg.train.samples_per_prompt)
        attempt = 0
        while True:
            chunks = _Chunks(self._score_soon, chunk)
            try:
                rollout = await self.body.source.batch(index, index - self.state.extra_batches, self.state, chunks.add)
                chunks.flush(rollout.records)
                break
            except Unavailable as exc:
                for task in chunks.scoring:
                    task.cancel()
                await asyncio.gather(*chunks.scoring, return_exceptions=True)  # their ends taken: no "never retrieved"
                await self.body.retries.again("actor", attempt, exc)
                attempt += 1
        rollout.scoring = chunks.scoring
        self.busy["generate"] += rollout.generate_s
        return rollout

    def _score_soon(self, records: list[PromptRecord], samples: list[Sample]) -> asyncio.Future:
        """Reward scores (and critic values) of a streamed chunk, started now."""
        return asyncio.gather(
            self.roles.reward.score(score_items(records, samples)),
            self.roles.critic.compute_values(to_batch(samples)) if self.roles.critic else _none(),
        )

    async def _score(self, rollout: Rollout) -> None:
        """The scores and values of the streamed chunks (most already done), in sample order."""
        start = time.perf_counter()
        # A one-pass update's batch needs the reference's logprobs alone, which no update changes:
        # asked for now, beside the scores, the actor computes them as soon as its trainer is free.
        reference = (self.roles.actor.compute_logprobs(rollout.batch, self.cfg.sampling.temperature,
                                                       include_reference=True, reference_only=True)
                     if self.cfg.one_pass_update else _none())
        (*scored, rollout.logprobs) = await asyncio.gather(*rollout.scoring, reference)
        rewards, values = zip(*scored)
        rollout.reward = ScoreResult.concat(list(rewards))
        rollout.values = CriticValues.concat(list(values)) if self.roles.critic else None
        rollout.score_s = spent("score", start)
        self.busy["score"] += rollout.score_s

    async def _fresh(self, rollout: Rollout) -> Rollout | None:
        """The rollout if its oldest sample is within the bound; else counted, logged, and generated
        again (scored inline) or dropped."""
        counts = self.state.counts
        while self.version - rollout.oldest_version > self.p.max_staleness:
            stale = sum(self.version - s.policy_version > self.p.max_staleness for s in rollout.samples)
            counts.stale_samples += stale
            metrics.PIPELINE_STALE_SAMPLES.labels("coordinator").inc(stale)
            log.warning("rollout batch %d: %d samples from policy version %d, %d behind the actor's %d "
                        "(pipeline.max_staleness=%d); %s", rollout.index, stale, rollout.oldest_version,
                        self.version - rollout.oldest_version, self.version, self.p.max_staleness,
                        "dropping it" if self.p.on_stale == "drop" else "generating it again")
            # A batch with carried episodes cannot be generated again (they moved on): dropped.
            if self.p.on_stale == "drop" or self.body.source.carrying:
                counts.dropped_batches += 1
                await self._notify()  # its replacement may be generated
                return None
            counts.regenerated_batches += 1
            rollout = await self._rollout(rollout.index)
            await self._score(rollout)
        return rollout

    # --- plumbing ----------------------------------------------------------------------------------

    def _may_generate(self, index: int) -> bool:
        return self._held_by(index) is None

    def _held_by(self, index: int) -> str | None:
        """What keeps batch `index` from being generated now (the call trace's name for the wait),
        or None: it is still needed (a dropped batch needs a replacement), can be trained on in
        time, and nothing downstream is backed up."""
        # The step it will be trained at, as far as is known: batches dropped past the bound and a
        # step's refills (dynamic sampling) move it earlier, and `extra_batches` counts both.
        step = index - self.state.extra_batches
        if step > self.cfg.train.total_steps:
            return "no batch left"
        # Steps trained, not the actor's version: during the critic's warm-up the critic's values
        # age a version a step while the policy stands still.
        if step - 1 - self.state.step > self.p.max_staleness:
            return "staleness bound"
        return "backpressure" if self._backed_up() else None

    def _backed_up(self) -> bool:
        """Backpressure: a queue downstream of generation is filled past the threshold."""
        return any(q.qsize() > self.p.backpressure_threshold * q.maxsize for q in (self.generated, self.scored))

    async def _wait(self, ready: Callable[[], bool], what: str | None = None) -> None:
        """Until `ready()`; a wait that blocks is a slice `what` on the call trace."""
        if ready():
            return
        with self.clock.span(what) if what else contextlib.nullcontext():
            async with self.changed:
                await self.changed.wait_for(ready)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _depths(self) -> None:
        metrics.PIPELINE_QUEUE_DEPTH.labels("coordinator", "generated").set(self.generated.qsize())
        metrics.PIPELINE_QUEUE_DEPTH.labels("coordinator", "scored").set(self.scored.qsize())

    def _pipeline_stats(self, lag: torch.Tensor, now: float) -> dict[str, float]:
        wall = max(now - self.start, 1e-9)
        return {
            "pipeline/version_lag/mean": lag.mean().item(), "pipeline/version_lag/max": lag.max().item(),
            **{f"pipeline/{name}": float(v) for name, v in asdict(self.state.counts).items()},
            "pipeline/queue/generated": float(self.generated.qsize()),
            "pipeline/queue/scored": float(self.scored.qsize()),
            **{f"pipeline/busy/{stage}": seconds / wall for stage, seconds in self.busy.items()},
        }


class _Chunks:
    """A batch's finished samples sent to be scored as they end, `size` or more at a time."""

    def __init__(self, score_soon: Callable[[list[PromptRecord], list[Sample]], asyncio.Future], size: int):
        self.score_soon, self.size = score_soon, size
        self.pending: list[Sample] = []
        self.scoring: list[asyncio.Future] = []

    def add(self, records: list[PromptRecord], samples: list[Sample]) -> None:
        self.pending += samples
        if len(self.pending) >= self.size:
            self.flush(records)

    def flush(self, records: list[PromptRecord]) -> None:
        if self.pending:
            self.scoring.append(self.score_soon(records, self.pending))
            self.pending = []


async def _none() -> None:
    return None

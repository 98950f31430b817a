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
   again or dropped, `pipeline.on_stale`); actor.ComputeLogProbs with the current policy (the
   proximal policy: the PPO ratio starts at 1, and the rollout policy's lag is corrected by
   `actor.is_correction`), unless the update is one pass (its own forward computes them: the
   policy's pass that waits for the update before is gone); advantages; actor.Update |
   critic.Update, once the batches the bound lets precede this update have been generated
   (`pipeline.order: exact`: each batch lags by exactly the bound, whatever the timing, so runs
   repeat for a fixed seed; `eager`: at once, so that a split actor trains while it generates, each
   batch lagging by what the timing gives, within the bound); the step's record.

A transient failure (UNAVAILABLE, a deadline) of a role call is retried `pipeline.retries` times:
every call is safe to repeat (generation is seeded, scoring pure, updates idempotent per step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from rolefleet.actor.types import LogProbs, Sample
from rolefleet.algos import KL_CONTROLLERS
from rolefleet.common import metrics
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import Unavailable
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.checkpoints import Checkpointer
from rolefleet.coordinator.checks import require_finite
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.evaluation import Evaluator
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import (
    Roles,
    first_group_id,
    group_ids,
    policy_targets_for,
    sampling_for,
    score_items,
    to_batch,
)
from rolefleet.coordinator.state import RunStatus
from rolefleet.coordinator.step_metrics import step_record
from rolefleet.coordinator.targets import after_one_pass, step_targets
from rolefleet.critic.types import CriticValues
from rolefleet.reward.types import ScoreResult
from rolefleet.tasks import PromptRecord

log = logging.getLogger(__name__)
STAGES = ("generate", "score", "train")


@dataclass
class Rollout:
    index: int  # 1-based rollout batch number (its data batch, seed and group ids)
    records: list[PromptRecord]
    samples: list[Sample]
    batch: SequenceBatch
    generate_s: float
    scoring: list[asyncio.Future] = field(default_factory=list)  # reward + critic calls per streamed chunk, in order
    reward: ScoreResult | None = None
    values: torch.Tensor | None = None
    values_version: int = 0  # the critic version that computed the oldest of them (its Update's fence)
    reference: LogProbs | None = None  # for a one-pass update: the reference's logprobs, asked for with the scores
    score_s: float = 0.0

    @property
    def oldest_version(self) -> int:
        return min(s.policy_version for s in self.samples)


class Pipeline:
    def __init__(self, cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus,
                 clock: BusyClock | None = None, checkpointer: Checkpointer | None = None,
                 resumed: dict | None = None):
        if clock is None:  # run directly, not through `loop.train`: time the roles here
            clock = BusyClock()
            roles = clock.track(roles)
        self.cfg, self.roles, self.logger, self.status, self.clock = cfg, roles, logger, status, clock
        self.checkpointer = checkpointer or Checkpointer(cfg)
        self.p = cfg.pipeline
        self.dataset = PromptDataset.for_run(cfg)
        self.evaluator = Evaluator.for_run(cfg, self.dataset)
        self.generated: asyncio.Queue[Rollout] = asyncio.Queue(self.p.queue_capacity)
        self.scored: asyncio.Queue[Rollout] = asyncio.Queue(self.p.queue_capacity)
        self.counts = {"stale_samples": 0, "dropped_batches": 0, "regenerated_batches": 0, "retries": 0}
        # Resumed after checkpoint k: step k's update was the last; batches after it are generated
        # again (from the loaded policy, so lags may differ from the interrupted run's).
        self.done, self.kl_coef = 0, cfg.train.kl_coef
        if resumed is not None:
            self.done, self.kl_coef = resumed["step"], resumed["kl_coef"]
            self.counts.update(resumed.get("counts", {}))
            if "data" in resumed:  # not in the checkpoint of step 0
                self.dataset.load_state_dict(resumed["data"])
        self.version = self.done    # the actor's policy version: updates applied this run
        self.generated_batches = self.done + self.counts["dropped_batches"]  # batches the generate stage finished
        self.changed = asyncio.Condition()  # the version moved or a queue drained
        self.busy = dict.fromkeys(STAGES, 0.0)
        self.trained: list[int] = []  # sample ids in the order they were trained on
        self.start = time.perf_counter()

    async def run(self) -> None:
        """Until the train stage has trained `total_steps` batches (or a stop); a stage that fails
        ends the run with its error."""
        if self.evaluator is not None and self.done == 0:  # the starting policy, before any batch
            await self.evaluator.before_training(self.logger, self.status, *self._eval_calls())
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
        t, s = self.cfg.train, self.cfg.sampling
        kl_coef, kl_controller = self.kl_coef, KL_CONTROLLERS.get(t.kl_controller)
        last = time.perf_counter()
        step = saved = self.done
        while step < t.total_steps:
            await self.status.wait_resumed()  # paused: no update starts
            if self.status.stop_requested:
                break
            with self.clock.span("train waits (scored batch)") if self.scored.empty() else contextlib.nullcontext():
                rollout = await self.scored.get()
            await self._notify()
            rollout = await self._fresh(rollout)
            if rollout is None:  # dropped past the bound; the step trains on the next batch
                continue
            step += 1
            start = time.perf_counter()
            samples, batch = rollout.samples, rollout.batch
            one_pass = rollout.reference is not None  # the update computes the policy's logprobs itself
            logprobs = (rollout.reference if one_pass else
                        await self._call(self.roles.actor.compute_logprobs, batch, s.temperature, True))
            with self.clock.span("train computes targets"):
                require_finite(samples, rollout.reward.total, rollout.values, logprobs, self.cfg.reward.function)
                targets = step_targets(self.cfg.preset.estimator, batch, rollout.reward.total, rollout.values,
                                       logprobs.logprobs, logprobs.ref_logprobs, group_ids(samples), kl_coef, t)
                policy_targets = policy_targets_for(self.cfg, targets, logprobs, samples)
            step_kl_coef = kl_coef
            kl_coef = kl_controller(kl_coef, targets.kl.mean().item(), t.kl_target, t.kl_horizon, len(samples))
            if self.p.order == "exact":
                # Every batch that may be generated from the policy before this update is, first:
                # each batch then lags by exactly what the bound allows, whatever the timing (runs
                # repeat for a fixed seed). Backed-up queues let the update go first (generation
                # waits on them). Eager order skips this: the update overlaps the next generation.
                ahead = min(step + self.p.max_staleness, t.total_steps) + self.counts["dropped_batches"]
                await self._wait(lambda n=ahead: self.generated_batches >= n or self._backed_up(),
                                 "update waits (exact order)")
            update_start = time.perf_counter()
            actor_result, critic_result = await asyncio.gather(
                self._call(self.roles.actor.update, step, rollout.oldest_version, batch, policy_targets,
                           s.temperature),
                self._call(self.roles.critic.update, step, batch, targets.returns, rollout.values,
                           rollout.values_version)
                if self.roles.critic else _none(),
            )
            if one_pass:
                logprobs, targets = after_one_pass(t, logprobs, targets, actor_result)
            lag = torch.tensor([self.version - smp.policy_version for smp in samples], dtype=torch.float32)
            self.trained += [smp.sample_id for smp in samples]
            self.checkpointer.trained(step, samples, actor_result.model_version)
            async with self.changed:
                self.version = actor_result.model_version
                self.changed.notify_all()
            now = time.perf_counter()
            self.busy["train"] += now - start
            metrics.STAGE_SECONDS.labels("coordinator", "train").inc(now - start)
            seconds = {"generate": rollout.generate_s, "score": rollout.score_s, "update": now - update_start,
                       "step": now - last}
            last = now
            record = step_record(step, actor_result, critic_result, batch, samples, rollout.reward,
                                 rollout.values, logprobs, targets, seconds)
            record["kl_coef"] = step_kl_coef
            if step == 1:
                record.update(self.dataset.stats)  # what the load kept, filtered and truncated
            record.update(self._pipeline_stats(lag, now))
            record.update(self.clock.fractions())
            if self.evaluator is not None and self.evaluator.due(step):
                # In the train stage: the next update waits for it, generation goes on (within the
                # bound) and has the rollout engine in turns with it (coordinator/evaluation.py).
                record.update(await self.evaluator.run(step, *self._eval_calls()))
            self.logger.log(record)
            self.status.record_step(record, actor_result.model_version)
            if self.checkpointer.due(step):
                await self._checkpoint(step, kl_coef)
                saved = step
        if self.status.stop_requested and step > saved and self.cfg.checkpoint.at_end:  # a stopped run can resume
            await self._checkpoint(step, kl_coef)

    async def _checkpoint(self, step: int, kl_coef: float) -> None:
        """After step `step`'s update: the batches of steps 1..step (and dropped ones) are used."""
        self.dataset.position = (step + self.counts["dropped_batches"]) * self.cfg.train.prompts_per_step
        await self.checkpointer.save(self.roles, step, step, {"kl_coef": kl_coef, "data": self.dataset.state_dict(),
                                                              "counts": dict(self.counts)})

    # --- stage work --------------------------------------------------------------------------------

    async def _rollout(self, index: int) -> Rollout:
        """Generate batch `index`, sending each chunk of samples to the reward as it arrives (the
        reward scores while the actor still generates); a transient failure restarts the batch
        (generation is seeded: the same samples)."""
        records = self.dataset.batch(index, self.cfg.train.prompts_per_step)
        sampling = sampling_for(self.cfg, index)
        chunk = min(self.cfg.actor.rollout.batch_size, len(records) * sampling.n)
        for attempt in range(self.p.retries + 1):
            start, samples, pending, scoring = time.perf_counter(), [], [], []
            try:
                async for part in self.roles.actor.generate_stream([r.prompt for r in records], sampling,
                                                                   first_group_id(self.cfg, index)):
                    pending += part
                    if len(pending) >= chunk:
                        scoring.append(self._score_soon(records, pending))
                        samples, pending = samples + pending, []
                if pending:
                    scoring.append(self._score_soon(records, pending))
                    samples += pending
                break
            except Unavailable as exc:
                for task in scoring:
                    task.cancel()
                await asyncio.gather(*scoring, return_exceptions=True)  # their ends taken: no "never retrieved"
                await self._retry_or_raise(attempt, exc)
        seconds = time.perf_counter() - start
        self.busy["generate"] += seconds
        metrics.STAGE_SECONDS.labels("coordinator", "generate").inc(seconds)
        return Rollout(index, records, samples, to_batch(samples), seconds, scoring=scoring)

    def _score_soon(self, records: list[PromptRecord], samples: list[Sample]) -> asyncio.Future:
        """Reward scores (and critic values) of a streamed chunk, started now."""
        return asyncio.gather(
            self._call(self.roles.reward.score, score_items(records, samples)),
            self._call(self.roles.critic.compute_values, to_batch(samples)) if self.roles.critic else _none(),
        )

    async def _score(self, rollout: Rollout) -> None:
        """The scores and values of the streamed chunks (most already done), in sample order."""
        start = time.perf_counter()
        # A one-pass update's batch needs the reference's logprobs alone, which no update changes:
        # asked for now, beside the scores, the actor computes them as soon as its trainer is free.
        reference = (self._call(self.roles.actor.compute_logprobs, rollout.batch, self.cfg.sampling.temperature, True,
                                True) if self.cfg.one_pass_update else _none())
        (*scored, rollout.reference) = await asyncio.gather(*rollout.scoring, reference)
        rewards, values = zip(*scored)
        rollout.reward = ScoreResult.concat(list(rewards))
        if self.roles.critic:
            critic_values = CriticValues.concat(list(values))
            rollout.values, rollout.values_version = critic_values.values, critic_values.model_version
        else:
            rollout.values = torch.zeros(rollout.batch.num_response_tokens)
        rollout.score_s = time.perf_counter() - start
        self.busy["score"] += rollout.score_s
        metrics.STAGE_SECONDS.labels("coordinator", "score").inc(rollout.score_s)

    async def _fresh(self, rollout: Rollout) -> Rollout | None:
        """The rollout if its oldest sample is within the bound; else counted, logged, and generated
        again (scored inline) or dropped."""
        while self.version - rollout.oldest_version > self.p.max_staleness:
            stale = sum(self.version - s.policy_version > self.p.max_staleness for s in rollout.samples)
            self.counts["stale_samples"] += stale
            metrics.PIPELINE_STALE_SAMPLES.labels("coordinator").inc(stale)
            log.warning("rollout batch %d: %d samples from policy version %d, %d behind the actor's %d "
                        "(pipeline.max_staleness=%d); %s", rollout.index, stale, rollout.oldest_version,
                        self.version - rollout.oldest_version, self.version, self.p.max_staleness,
                        "dropping it" if self.p.on_stale == "drop" else "generating it again")
            if self.p.on_stale == "drop":
                self.counts["dropped_batches"] += 1
                await self._notify()  # its replacement may be generated
                return None
            self.counts["regenerated_batches"] += 1
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
        step = index - self.counts["dropped_batches"]  # the step it will be trained at (if none else drops)
        if step > self.cfg.train.total_steps:
            return "no batch left"
        if step - 1 - self.version > self.p.max_staleness:
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

    def _eval_calls(self) -> tuple[Callable[..., Awaitable], Callable[..., Awaitable]]:
        """Generate and Score for an evaluation, retried as every call of the pipeline is."""
        return (lambda *a: self._call(self.roles.actor.generate, *a),
                lambda *a: self._call(self.roles.reward.score, *a))

    async def _call(self, method: Callable[..., Awaitable], *args):
        """A role call, retried on a transient failure (each is safe to repeat)."""
        for attempt in range(self.p.retries + 1):
            try:
                return await method(*args)
            except Unavailable as exc:
                await self._retry_or_raise(attempt, exc)

    async def _retry_or_raise(self, attempt: int, exc: Unavailable) -> None:
        if attempt == self.p.retries:
            raise exc
        self.counts["retries"] += 1
        log.warning("transient failure, retrying (%d of %d): %s", attempt + 1, self.p.retries, exc)
        await asyncio.sleep(min(2.0 ** attempt * 0.1, 5.0))

    def _pipeline_stats(self, lag: torch.Tensor, now: float) -> dict[str, float]:
        wall = max(now - self.start, 1e-9)
        return {
            "pipeline/version_lag/mean": lag.mean().item(), "pipeline/version_lag/max": lag.max().item(),
            **{f"pipeline/{name}": float(v) for name, v in self.counts.items()},
            "pipeline/queue/generated": float(self.generated.qsize()),
            "pipeline/queue/scored": float(self.scored.qsize()),
            **{f"pipeline/busy/{stage}": seconds / wall for stage, seconds in self.busy.items()},
        }


async def _none() -> None:
    return None

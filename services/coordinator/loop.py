"""The run (`train`): the synchronous loop below (DESIGN "One step"), one numbered call per role per
phase, or with `pipeline.mode: async` the same phases as overlapping stages (`pipeline.py`).

1. actor.Generate                                    -> n samples per prompt
2. reward.Score | critic.ComputeValues | actor.ComputeLogProbs, concurrently; all of it finite
3. advantages and returns (the algorithm's estimator), KL-coefficient update
4. actor.Update | critic.Update, concurrently
5. evaluate on held-out prompts when due (actor.Generate + reward.Score: `evaluation.py`), log the step

Before step 1 (with `eval.*` on) the starting policy is evaluated into a record of step 0.
Algorithms without a critic (GRPO, RLOO, REINFORCE++) skip the critic calls; nothing else changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch

from rolefleet.actor.client import ActorClient
from rolefleet.actor.types import LogProbs, PolicyTargets, Sample, SamplingParams
from rolefleet.algos import KL_CONTROLLERS
from rolefleet.common import metrics
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition, Unavailable
from rolefleet.common.role_types import UpdateResult
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.call_trace import CallTrace, watch_event_loop
from rolefleet.coordinator.checkpoints import Checkpointer
from rolefleet.coordinator.checks import require_finite
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.evaluation import Evaluator
from rolefleet.coordinator.journal import FILENAME as JOURNAL_FILE
from rolefleet.coordinator.journal import Journal
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.coordinator.step_metrics import step_record
from rolefleet.coordinator.targets import Targets, after_one_pass, step_targets
from rolefleet.critic.client import CriticClient
from rolefleet.reward.client import RewardClient
from rolefleet.reward.types import ScoreItem
from rolefleet.tasks import PromptRecord

T = TypeVar("T")


@dataclass
class Roles:
    actor: ActorClient
    reward: RewardClient
    critic: Optional[CriticClient]


class Timer:
    """Wall time per phase, also exported as the coordinator's stage busy-time counter."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    async def __call__(self, phase: str, awaitable: Awaitable[T]) -> T:
        start = time.perf_counter()
        try:
            return await awaitable
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[phase] = elapsed
            metrics.STAGE_SECONDS.labels("coordinator", phase).inc(elapsed)


async def _unchanged(step: int, version: int) -> UpdateResult:
    return UpdateResult(step=step, model_version=version, stats={})


async def _nothing() -> None:
    return None


def to_batch(samples: list[Sample]) -> SequenceBatch:
    return SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])


def score_items(records: list[PromptRecord], samples: list[Sample]) -> list[ScoreItem]:
    return [ScoreItem(records[s.prompt_index].prompt, s.response_text, records[s.prompt_index].ground_truth,
                      records[s.prompt_index].extra) for s in samples]


def policy_version_of(samples: list[Sample]) -> int:
    versions = {s.policy_version for s in samples}
    if len(versions) != 1:
        # Sync mode generates a step with one policy; mixed versions mean the actor changed mid-step.
        raise FailedPrecondition(f"one step's samples came from several policy versions: {sorted(versions)}")
    return versions.pop()


def group_ids(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([smp.group_id for smp in samples])


def first_group_id(cfg: RoleFleetConfig, batch_index: int) -> int:
    """Group ids run on across the run's rollout batches (1-based), one per prompt."""
    return (batch_index - 1) * cfg.train.prompts_per_step


def sampling_for(cfg: RoleFleetConfig, step: int) -> SamplingParams:
    s = cfg.sampling
    # A per-step seed: a rerun of the same config samples the same rollouts.
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          n=cfg.train.samples_per_prompt, seed=cfg.run.seed * 100_003 + step,
                          stop_token_ids=tuple(s.stop_token_ids))


def policy_targets_for(cfg: RoleFleetConfig, targets: Targets, logprobs: LogProbs,
                       samples: list[Sample]) -> PolicyTargets:
    """What the actor's update needs; reference and rollout logprobs travel only when its loss uses them."""
    a = cfg.actor
    return PolicyTargets(
        advantages=targets.advantages,
        old_logprobs=logprobs.logprobs,
        ref_logprobs=logprobs.ref_logprobs if a.kl_loss_coef > 0 else None,
        rollout_logprobs=torch.cat([smp.logprobs for smp in samples]) if a.is_correction != "none" else None,
    )


async def require_fresh(roles: Roles) -> None:
    """Step ids start at 1 in every run; trainer roles that already applied steps (another run)
    would answer this run's steps with their recorded results. Resuming comes with checkpoints."""
    for name, client in (("actor", roles.actor), ("critic", roles.critic)):
        if client is None:
            continue
        st = await client.status()
        if st.broken:
            raise FailedPrecondition(f"the {name} refuses updates: {st.broken}")
        if st.last_step > 0:
            raise FailedPrecondition(f"the {name} already applied steps up to {st.last_step} in another run: "
                                     "restart the role servers for a new run")


async def train(cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus) -> RunStatus:
    """The run: `pipeline.mode` sync (below) or async (`coordinator/pipeline.py`)."""
    if (roles.critic is not None) != cfg.preset.uses_critic:
        raise ValueError(f"algorithm {cfg.algorithm} {'needs' if cfg.preset.uses_critic else 'takes no'} critic")
    with Journal(cfg.run.out / JOURNAL_FILE) as journal:
        journal.record_run(cfg.run.name, cfg.model_dump(mode="json"))
        checkpointer = Checkpointer(cfg, journal)
        resumed = await checkpointer.restore(roles) if cfg.run.resume else None
        if resumed is None:
            await require_fresh(roles)
            checkpointer.start_fresh()
            journal.rewind(-1)  # an earlier run's steps and checkpoints (step 0's too) are history now
            if cfg.run.max_restarts and cfg.checkpoint.periodic:  # what a lost trainer is recovered to at first
                await checkpointer.save(roles, 0, 0, {"kl_coef": cfg.train.kl_coef})
            elif cfg.run.max_restarts:
                print("rolefleet: checkpoints are off during the run (checkpoint.every=0, checkpoint.every_minutes=0): "
                      "a lost actor or critic will end the run; a lost reward costs nothing", flush=True)
        status.stepping = True
        if status.state == RunState.STARTING:  # not when paused or stopping meanwhile
            status.state = RunState.RUNNING
        clock = BusyClock(CallTrace.for_run(cfg.run.out, cfg.run.name) if cfg.run.call_trace else None)
        roles = clock.track(roles)
        watch = asyncio.create_task(watch_event_loop(clock.trace)) if clock.trace else None
        try:
            failures, failed_at = 0, -1
            while True:
                # What comes after the checkpoint is trained (again) now; the records of it go.
                start = resumed["step"] if resumed else 0
                journal.rewind(start)
                status.rewind(logger.rewind(start))
                try:
                    await _steps(cfg, roles, logger, status, clock, checkpointer, resumed)
                    break
                except Unavailable as exc:
                    # A budget per loss: it renews once the run has got past the step it failed at.
                    failures, failed_at = (failures + 1 if status.step <= failed_at else 1), max(failed_at, status.step)
                    if failures > cfg.run.max_restarts or status.stop_requested:
                        raise
                    resumed = await _recover(cfg, roles, checkpointer, exc, failures)
        finally:
            if watch is not None:
                watch.cancel()
            clock.close()
    status.state = RunState.STOPPED if status.step < cfg.train.total_steps else RunState.FINISHED
    return status


async def _steps(cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus, clock: BusyClock,
                 checkpointer: Checkpointer, resumed: dict | None) -> None:
    if cfg.pipeline.mode == "async":
        from rolefleet.coordinator.pipeline import Pipeline

        await Pipeline(cfg, roles, logger, status, clock, checkpointer, resumed).run()
    else:
        await train_sync(cfg, roles, logger, status, clock, checkpointer, resumed)


async def _recover(cfg: RoleFleetConfig, roles: Roles, checkpointer: Checkpointer, lost: Unavailable,
                   attempt: int) -> dict:
    """A role went away mid-run (its process died; `rolefleet up`, compose or Kubernetes start it
    again): once every role answers, the newest checkpoint goes back into the trainer roles (a
    restarted one starts from its initial weights, the others moved on since) and the run goes on
    from its step."""
    print(f"rolefleet: a role was lost ({lost}); recovery {attempt} of {cfg.run.max_restarts}: waiting for every "
          "role, then resuming from the newest checkpoint", flush=True)
    deadline = time.monotonic() + cfg.train.connect_timeout_s
    for client in (roles.actor, roles.reward, roles.critic):
        while client is not None:
            try:
                await client.status()
                break
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    resumed = await checkpointer.restore(roles)
    if resumed is None:
        raise FailedPrecondition(f"a role was lost ({lost}) and the run has no checkpoint to recover from: "
                                 "set checkpoint.every or checkpoint.every_minutes")
    return resumed


async def train_sync(cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus,
                     clock: BusyClock, checkpointer: Checkpointer, resumed: dict | None = None) -> None:
    dataset = PromptDataset.for_run(cfg)
    s, t = cfg.sampling, cfg.train
    kl_coef, kl_controller = t.kl_coef, KL_CONTROLLERS.get(t.kl_controller)
    done = 0  # the last step applied (and saved, when resumed from it)
    if resumed is not None:
        done, kl_coef = resumed["step"], resumed["kl_coef"]
        if "data" in resumed:  # not in the checkpoint of step 0
            dataset.load_state_dict(resumed["data"])  # refuses prompts that changed since
    saved = done
    evaluator = Evaluator.for_run(cfg, dataset)
    if evaluator is not None and done == 0:  # 0. The starting policy on the held-out prompts.
        await evaluator.before_training(logger, status, roles.actor.generate, roles.reward.score)
    for step in range(done + 1, t.total_steps + 1):
        await status.wait_resumed()
        if status.stop_requested:
            break
        timer, start = Timer(), time.perf_counter()
        records = dataset.batch(step, t.prompts_per_step)

        # 1. Rollouts from the current policy.
        samples = await timer("generate", roles.actor.generate([r.prompt for r in records], sampling_for(cfg, step),
                                                               first_group_id(cfg, step)))
        batch, version = to_batch(samples), policy_version_of(samples)

        # 2. Score, value and recompute logprobs at once: the three roles do not wait on each other.
        # A one-pass update takes the policy's from its own forward (during the critic's warm-up
        # the actor makes none: its logprobs come from here then).
        warming = step <= t.critic_warmup_steps
        one_pass = cfg.one_pass_update and not warming
        reward, critic_values, logprobs = await timer("score", asyncio.gather(
            roles.reward.score(score_items(records, samples)),
            roles.critic.compute_values(batch) if roles.critic else _nothing(),
            # Reference logprobs every step, even with no KL term: the `kl` metric watches the drift.
            roles.actor.compute_logprobs(batch, s.temperature, include_reference=True, reference_only=one_pass),
        ))
        values = critic_values.values if critic_values else torch.zeros(batch.num_response_tokens)
        scores = reward.total
        require_finite(samples, scores, values, logprobs, cfg.reward.function)

        # 3. Advantages and returns; the KL controller sees this step's KL.
        targets = step_targets(cfg.preset.estimator, batch, scores, values, logprobs.logprobs,
                               logprobs.ref_logprobs, group_ids(samples), kl_coef, t)
        step_kl_coef = kl_coef
        kl_coef = kl_controller(kl_coef, targets.kl.mean().item(), t.kl_target, t.kl_horizon, len(samples))

        # 4. Policy and value updates at once; during the critic's warm-up the policy waits (the
        # actor numbers its own steps from the first one it applies).
        actor_result, critic_result = await timer("update", asyncio.gather(
            _unchanged(step, version) if warming else roles.actor.update(
                step - t.critic_warmup_steps, version, batch, policy_targets_for(cfg, targets, logprobs, samples),
                s.temperature),
            roles.critic.update(step, batch, targets.returns, values, critic_values.model_version)
            if roles.critic else _nothing(),
        ))
        if one_pass:
            logprobs, targets = after_one_pass(t, logprobs, targets, actor_result)

        # 5. Evaluate when due (after the step's time: it is no part of a training step), and log.
        timer.seconds["step"] = time.perf_counter() - start
        record = step_record(step, actor_result, critic_result, batch, samples, reward, values, logprobs,
                             targets, timer.seconds)
        if evaluator is not None and evaluator.due(step):
            record.update(await evaluator.run(step, roles.actor.generate, roles.reward.score))
        if step == 1:
            record.update(dataset.stats)  # what the load kept, filtered and truncated
        record["kl_coef"] = step_kl_coef
        if warming:
            record["critic_warmup"] = 1.0
        record.update(clock.fractions())
        checkpointer.trained(step, samples, actor_result.model_version)
        logger.log(record)
        status.record_step(record, actor_result.model_version)
        done = step
        dataset.position = step * t.prompts_per_step  # the prompts of steps 1..step are used

        # 6. Checkpoint, when due.
        if checkpointer.due(step):
            await checkpointer.save(roles, step, max(0, step - t.critic_warmup_steps),
                                    {"kl_coef": kl_coef, "data": dataset.state_dict()})
            saved = step
    if status.stop_requested and done > saved and cfg.checkpoint.at_end:  # a stopped run can resume
        await checkpointer.save(roles, done, max(0, done - t.critic_warmup_steps),
                                {"kl_coef": kl_coef, "data": dataset.state_dict()})

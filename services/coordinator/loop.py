"""The run (`train`): the steps of `pipeline.mode` sync (below) or async (`pipeline.py`) around the
journal, the checkpoint they resume from, and the recovery from a lost role.

Sync mode, each step one numbered call per role per phase (DESIGN "One step"):

1. actor.Generate                                    -> n samples per prompt (the rollout source,
   `source.py`: episodes, carried ones, and with train.dynamic_sampling also reward.Score and more
   batches until the step has its groups)
2-6. the step body on them (`step.py`): reward.Score | critic.ComputeValues | actor.ComputeLogProbs;
   advantages and the KL coefficient; actor.Update | critic.Update; the step's record (with an
   evaluation when due); a checkpoint when due

Before step 1 (with `eval.*` on) the starting policy is evaluated into a record of step 0.
Algorithms without a critic (GRPO, RLOO, REINFORCE++) skip the critic calls; nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from rolefleet.common import metrics
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition, Unavailable
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.call_trace import CallTrace, watch_event_loop
from rolefleet.coordinator.calls import Roles, answering
from rolefleet.coordinator.checkpoints import Checkpointer
from rolefleet.coordinator.journal import FILENAME as JOURNAL_FILE
from rolefleet.coordinator.journal import Journal
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.pipeline import Pipeline
from rolefleet.coordinator.saved_state import CoordinatorState
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.coordinator.step import Schedule, StepBody
from rolefleet.coordinator.supervised import SupervisedSteps

__all__ = ["Roles", "train", "train_sync"]


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
                await checkpointer.save(roles, CoordinatorState(step=0, kl_coef=cfg.train.kl_coef), actor_step=0)
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
                start = resumed.step if resumed else 0
                journal.rewind(start)
                status.rewind(logger.rewind(start, resumed.record if resumed else None))
                try:
                    await _steps(cfg, roles, logger, status, clock, checkpointer, resumed)
                    break
                except Unavailable as exc:
                    # A budget per loss: it renews once the run has got past the step it failed at.
                    failures, failed_at = (failures + 1 if status.step <= failed_at else 1), max(failed_at, status.step)
                    if failures > cfg.run.max_restarts or status.stop_requested:
                        raise
                    lost_at, since = status.step, time.monotonic()
                    resumed = await _recover(cfg, roles, checkpointer, exc, failures, status)
                    # Whole steps trained again (the one in flight is not counted: it never ended).
                    checkpointer.recovery = {"recovery/steps_lost": float(lost_at - resumed.step),
                                             "recovery/seconds": time.monotonic() - since}
                    print(f"rolefleet: recovered: continuing after step {resumed.step} "
                          f"({lost_at - resumed.step} finished steps to train again)", flush=True)
            checkpointer.drop_snapshots()  # the run ended as it meant to: nothing left to recover
        except Exception:
            with contextlib.suppress(Exception):  # the record of a step kept before the failure
                await checkpointer.settle()
            raise
        finally:
            if watch is not None:
                watch.cancel()
            clock.close()
    status.state = RunState.STOPPED if status.step < cfg.train.total_steps else RunState.FINISHED
    return status


async def _steps(cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus, clock: BusyClock,
                 checkpointer: Checkpointer, resumed: CoordinatorState | None) -> None:
    if cfg.preset.supervised:  # the data's completions are the targets: no rollouts (`supervised.py`)
        await SupervisedSteps(cfg, roles, logger, status, clock, checkpointer, resumed).run()
    elif cfg.pipeline.mode == "async":
        await Pipeline(cfg, roles, logger, status, clock, checkpointer, resumed).run()
    else:
        await train_sync(cfg, roles, logger, status, clock, checkpointer, resumed)


async def _recover(cfg: RoleFleetConfig, roles: Roles, checkpointer: Checkpointer, lost: Unavailable,
                   attempt: int, status: RunStatus) -> CoordinatorState:
    """A role went away mid-run (its process died; `rolefleet up`, compose or Kubernetes start it
    again): once every role answers, the newest snapshot (the step before the one in flight) or
    checkpoint goes back into the trainer roles (a restarted one starts from its initial weights,
    the others may have applied the step in flight) and the run goes on from its step."""
    print(f"rolefleet: a role was lost ({lost}); recovery {attempt} of {cfg.run.max_restarts}: waiting for every "
          "role, then resuming from the newest snapshot or checkpoint", flush=True)
    deadline = time.monotonic() + cfg.train.connect_timeout_s
    for name, client in (("actor", roles.actor), ("reward", roles.reward), ("critic", roles.critic)):
        if client is not None and await answering(client, deadline, give_up=lambda: status.stop_requested) is None:
            if status.stop_requested:  # a stop is not held for the whole wait by a role that may not return
                raise Unavailable(f"the run was asked to stop while waiting for the {name} after the loss ({lost})")
            raise Unavailable(f"the {name} has not answered for train.connect_timeout_s={cfg.train.connect_timeout_s:g} s "
                              f"after the loss ({lost})")
    resumed = await checkpointer.restore(roles)
    if resumed is None:
        raise FailedPrecondition(f"a role was lost ({lost}) and the run has no checkpoint to recover from: "
                                 "set checkpoint.every or checkpoint.every_minutes")
    return resumed


async def train_sync(cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus,
                     clock: BusyClock, checkpointer: Checkpointer, resumed: CoordinatorState | None = None) -> None:
    body = StepBody(cfg, roles, logger, status, clock, checkpointer, resumed)
    await body.evaluate_start()
    for step in range(body.state.step + 1, cfg.train.total_steps + 1):
        await status.wait_resumed()
        if status.stop_requested:
            break
        start = time.perf_counter()
        # 1. Rollouts from the current policy (`source.py`: with dynamic sampling, scored as they come).
        rollout = await body.source.step(step, body.state)
        # 2-6. Score, advantages, update, record, checkpoint.
        await body.run(step, rollout, since=start, schedule=_PHASES)
    await body.finish()


class _Phases(Schedule):
    """Sync mode's phases are what the coordinator's busy-time counter counts (async mode: its stages)."""

    async def updated(self, rollout, actor, now, seconds):
        for phase in ("score", "update"):
            metrics.STAGE_SECONDS.labels("coordinator", phase).inc(seconds[phase])
        return {}


_PHASES = _Phases()

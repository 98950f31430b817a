"""The coordinator's side of checkpoints (docs/checkpoints.md; the layout: trainer/checkpoint.py).

Saving step k: the actor and the critic write their parts at once (SaveCheckpoint), then the
coordinator writes its own state, then the manifest, the mark of a complete checkpoint; older ones
beyond `checkpoint.keep` go after it. Resuming: the newest complete checkpoint is loaded into the
roles (LoadCheckpoint), which report the version and step they hold, and its coordinator state
(`saved_state.CoordinatorState`) comes back to the run: the next step, the data position, the KL
coefficient, the pipeline's counts. Both modes save and resume it the same way.

Snapshots (`checkpoint.snapshot`) are checkpoints in memory after every step, written behind the
next one (`snapshot`: the trainers stage their state and answer, the files and the manifest follow);
a trainer that comes back as a new process is loaded alone from the one of the run's step
(`restore_role`, through `calls.Retries`), the whole run from the newest otherwise (`restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolefleet.coordinator.journal import Journal
from rolefleet.coordinator.saved_state import STATE_FILE, CoordinatorState, read_state, write_state
from rolefleet.trainer.checkpoint import MANIFEST, complete_checkpoints, prune, step_dir, write_atomic, write_json

log = logging.getLogger(__name__)
SUGGESTED_COST = 0.03  # share of a run's time that the suggested checkpoint.every spends saving
# Why a snapshot may fail where a checkpoint would not be tried again: a full or missing memory
# volume, a trainer that cannot write in it. Snapshots are then off; the run goes on.
SNAPSHOT_FAILURES = (FailedPrecondition, InvalidArgument, OSError)
_COMPLETING = contextvars.ContextVar("completing_a_snapshot", default=False)


async def _nothing() -> None:
    return None


def _loaded_as_saved(name: str, loaded, expected: dict, path: Path) -> None:
    """FailedPrecondition unless trainer `name` loaded from `path` the step and version its manifest says."""
    if (loaded.step, loaded.model_version) != (expected["step"], expected["model_version"]):
        raise FailedPrecondition(f"run.resume: the {name} loaded step {loaded.step} version {loaded.model_version}, "
                                 f"the manifest of {path} says step {expected['step']} version "
                                 f"{expected['model_version']}")


class Checkpointer:
    """Checkpoints, and the journal's record of each step's samples (None: not journaled)."""

    def __init__(self, cfg: RoleFleetConfig, journal: Journal | None = None):
        self.cfg, self.journal = cfg, journal
        self.root = cfg.checkpoint.root(cfg.run).resolve()  # roles are told absolute paths
        snapshot = cfg.checkpoint.snapshot
        self.snapshots = snapshot.root(cfg.run).resolve() if snapshot.enabled else None
        # This coordinator's own snapshots: a role never meets another run's (or start's) under its path.
        self.instance = os.urandom(4).hex()
        self.last_saved = time.monotonic()  # `checkpoint.every_minutes` counts from here (the run's start)
        self.recovery: dict[str, float] = {}  # the last recovery's metrics, for the next step's record
        self.save_s: float | None = None  # the last checkpoint's seconds (what `suggest_every` weighs)
        self._pending: asyncio.Task | None = None  # the snapshot whose files are being written
        self._restoring: dict[str, asyncio.Lock] = {}  # a trainer loaded alone (`restore_role`), once at a time
        self._suggested = False

    def start_fresh(self) -> None:
        """A new run (not resuming) in a directory with an earlier run's checkpoints: they are moved
        aside, not deleted (metrics.jsonl is started anew too), so that resuming this run, or
        recovering it, never loads the other run's."""
        if self.root.is_dir() and any(self.root.iterdir()):
            aside = self.root.with_name(f"{self.root.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            self.root.rename(aside)
            log.warning("a new run (run.resume is false): the earlier run's checkpoints moved to %s", aside)
        self.drop_snapshots()

    def drop_snapshots(self) -> None:
        """Snapshots are for recovering the run that wrote them: gone with a new run and a finished one."""
        if self.snapshots is not None:
            shutil.rmtree(self.snapshots, ignore_errors=True)

    def take_recovery(self) -> dict[str, float]:
        """The last recovery's metrics (`recovery/*`), once: for the first record after it."""
        taken, self.recovery = self.recovery, {}
        return taken

    def trained(self, step: int, samples, policy_version: int) -> None:
        """Step `step` was trained on `samples`: the journal refuses a sample id trained twice."""
        if self.journal is not None:
            self.journal.record_step(step, [s.sample_id for s in samples], policy_version)

    def due(self, step: int) -> bool:
        return self.cfg.checkpoint.due(step, self.cfg.train.total_steps, (time.monotonic() - self.last_saved) / 60)

    async def save(self, roles, state: CoordinatorState, actor_step: int) -> Path:
        """Checkpoint `state.step` (`actor_step`: the actor's own step id, behind during critic
        warm-up); `state`: the coordinator's part."""
        await self.settle()  # a snapshot being written: complete first, its step recorded
        start, step = time.perf_counter(), state.step
        path = step_dir(self.root, step)
        manifest = await self._write(roles, state, actor_step, path)
        if self.journal is not None:
            self.journal.record_checkpoint(step, str(path), manifest)
        for old in prune(self.root, self.cfg.checkpoint.keep):
            log.info("checkpoint %s removed (checkpoint.keep=%d)", old, self.cfg.checkpoint.keep)
        self.last_saved = time.monotonic()
        self.save_s = time.perf_counter() - start
        log.info("checkpoint of step %d written to %s in %.1f s", step, path, self.save_s)
        return path

    def suggest_every(self, step_s: float) -> None:
        """Without snapshots a lost trainer goes back to the newest checkpoint: once, from the
        measured save and step times, the `checkpoint.every` that bounds that loss at about
        `SUGGESTED_COST` of the run's time (nothing when the config sets it, or nothing was saved)."""
        c = self.cfg.checkpoint
        if self._suggested or self.snapshots is not None or c.every or self.save_s is None or step_s <= 0:
            return
        self._suggested = True
        every = max(1, math.ceil(self.save_s / (SUGGESTED_COST * step_s)))
        print(f"rolefleet: snapshots are off, so a lost actor or critic goes back to the newest checkpoint; a "
              f"checkpoint took {self.save_s:.1f} s and a step {step_s:.1f} s here: checkpoint.every={every} would "
              f"bound that loss to {every} steps at about {SUGGESTED_COST:.0%} of the run's time", flush=True)

    async def keep(self, roles, step: int, state: Callable[[], CoordinatorState],
                   actor_step: Callable[[CoordinatorState], int], log: Callable[[dict[str, float]], None]) -> bool:
        """Step `step` kept, then its record logged (`log(kept)`; the record travels in the state
        `state()` gives, asked for only when something is written): a checkpoint when due (True),
        else a snapshot (logged once it is complete), else logged at once. A recorded step is never
        trained again, nor a kept one unrecorded."""
        if self.due(step):
            s = state()
            await self.save(roles, s, actor_step(s))
            log({})
            return True
        if self.snapshots is None:
            log({})
        else:
            s = state()
            await self.snapshot(roles, s, actor_step(s), log)
        return False

    async def snapshot(self, roles, state: CoordinatorState, actor_step: int,
                       then: Callable[[dict[str, float]], None]) -> None:
        """A snapshot of `state.step` (`checkpoint.snapshot`): a checkpoint in memory, the trainers'
        parts on their own machines. Returns once the trainers hold their state off the device
        (SaveCheckpoint in the background); the files, the manifest and the removal of the previous
        snapshot follow behind the next step, and then `then(metrics)` (the step's record). A
        snapshot that fails turns them off and calls `then` at once; one that a lost role leaves
        incomplete never calls it (its step is trained again)."""
        await self.settle()  # the previous one complete: one at a time
        if self.snapshots is None:  # the previous one failed meanwhile, which turned them off
            then({})
            return
        start = time.perf_counter()
        path = step_dir(self.snapshots / self.instance, state.step)
        coordinator = copy.deepcopy(state)  # as of now: the next step changes the state
        try:
            path.mkdir(parents=True, exist_ok=True)
            await self._save_trainers(roles, state.step, actor_step, path, background=True)
        except SNAPSHOT_FAILURES as exc:
            self._snapshots_off(state.step, exc)
            then({})
            return
        staged = time.perf_counter() - start

        async def complete() -> None:
            _COMPLETING.set(True)  # in this task's context, and the calls' tasks it starts
            try:
                # The same requests again: answered once each trainer's files are complete.
                actor, critic = await self._save_trainers(roles, state.step, actor_step, path)
                self._finish(path, state.step, coordinator, actor, critic)
            except SNAPSHOT_FAILURES as exc:
                self._snapshots_off(state.step, exc)
                then({})
                return
            for _, old in self._snapshots()[:-1]:
                shutil.rmtree(old, ignore_errors=True)
            for other in self.snapshots.iterdir():  # an earlier coordinator start's, superseded now
                if other.name != self.instance:
                    shutil.rmtree(other, ignore_errors=True)
            then({"checkpoint/snapshot_s": staged, "checkpoint/snapshot_write_s": time.perf_counter() - start})

        self._pending = asyncio.create_task(complete())

    async def settle(self) -> None:
        """Until the snapshot being written is complete (its step recorded); a role lost meanwhile
        is raised (Unavailable), as the call that met it would, to every caller until the recovery."""
        if self._pending is not None:
            await self._pending

    def _snapshots_off(self, step: int, exc: Exception) -> None:
        log.warning("snapshots are off for the rest of the run: the snapshot of step %d failed (%s); a lost "
                    "trainer is recovered from the checkpoints (checkpoint.every_minutes, checkpoint.every)",
                    step, exc)
        self.snapshots = None

    def _snapshots(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete snapshot, by step."""
        if self.snapshots is None or not self.snapshots.is_dir():
            return []
        return sorted(found for start in self.snapshots.iterdir() if start.is_dir()
                      for found in complete_checkpoints(start))

    async def _write(self, roles, state: CoordinatorState, actor_step: int, path: Path) -> dict:
        """The trainers' parts (at once), the coordinator's state, then the manifest; the manifest."""
        path.mkdir(parents=True, exist_ok=True)
        actor, critic = await self._save_trainers(roles, state.step, actor_step, path)
        return self._finish(path, state.step, state, actor, critic)

    @staticmethod
    async def _save_trainers(roles, step: int, actor_step: int, path: Path, background: bool = False):
        return await asyncio.gather(
            roles.actor.save_checkpoint(actor_step, str(path / "actor"), background=background),
            roles.critic.save_checkpoint(step, str(path / "critic"), background=background) if roles.critic
            else _nothing())

    def _finish(self, path: Path, step: int, coordinator: CoordinatorState, actor, critic) -> dict:
        """After the trainers' parts: the coordinator's state, then the manifest; the manifest."""
        write_state(path, coordinator, write_atomic)
        roles_done = {"actor": {"step": actor.step, "model_version": actor.model_version}}
        if critic is not None:
            roles_done["critic"] = {"step": critic.step, "model_version": critic.model_version}
        manifest = {"step": step, "run": self.cfg.run.name, "algorithm": self.cfg.algorithm,
                    "created": time.time(), "roles": roles_done, "coordinator": STATE_FILE}
        write_json(path / MANIFEST, manifest)
        return manifest

    async def restore(self, roles) -> CoordinatorState | None:
        """Load the newest complete checkpoint or snapshot into the roles; its coordinator state
        (None: there is none yet, the run starts at step 1). A snapshot that a trainer does not
        hold (its machine's memory went with it: a pod moved) gives way to the next newest."""
        with contextlib.suppress(Unavailable):  # a snapshot being written: complete, or left incomplete
            await self.settle()
        self._pending = None
        # Newest first; a checkpoint before a snapshot of the same step (it is on lasting storage).
        found = sorted([(step, 1, path) for step, path in complete_checkpoints(self.root)]
                       + [(step, 0, path) for step, path in self._snapshots()], reverse=True)
        for step, durable, path in found:
            try:
                state = await self._load(roles, path)
                # Later snapshots under new paths: a trainer's part of a step redone now must never
                # be taken for the one it wrote of that step before the loss (a save repeated is
                # answered from disk).
                self.instance = os.urandom(4).hex()
                return state
            except InvalidArgument as exc:
                if durable:
                    raise
                log.warning("snapshot of step %d not loaded (%s); trying the next newest", step, exc)
        log.warning("run.resume: no complete checkpoint under %s; starting from step 1", self.root)
        return None

    async def restore_role(self, client, name: str, step: int, since: float) -> bool:
        """Trainer `name` (its `client`), back as a new process mid-run, loaded alone from the run's
        checkpoint or snapshot of run step `step`, the one the other roles hold: the run goes on
        where it was. False when there is none of that step (nor one it can load); `since`: when the
        loss began (time.monotonic), for the next record's `recovery/*`."""
        if self._pending is not None and not _COMPLETING.get():  # (not from within it: it would wait on itself)
            await asyncio.wait({self._pending})  # the snapshot of `step` may be the one being written
        async with self._restoring.setdefault(name, asyncio.Lock()):  # calls that failed at once: one load
            return await self._restore_role(client, name, step, since)

    async def _restore_role(self, client, name: str, step: int, since: float) -> bool:
        for found, path in [*complete_checkpoints(self.root), *self._snapshots()]:  # lasting storage first
            expected = json.loads((path / MANIFEST).read_text())["roles"].get(name) if found == step else None
            if expected is None:
                continue
            if (await client.status()).last_step == expected["step"]:
                return True  # loaded by another call that failed with this one
            try:
                loaded = await client.load_checkpoint(str(path / name))
            except InvalidArgument as exc:  # its machine does not hold this snapshot's part (a moved pod)
                log.warning("the %s cannot load %s (%s)", name, path, exc)
                continue
            _loaded_as_saved(name, loaded, expected, path)
            self.recovery = {"recovery/steps_lost": 0.0, "recovery/seconds": time.monotonic() - since}
            print(f"rolefleet: the {name} came back as a new process; loaded alone from {path}, the run goes on "
                  f"with step {step + 1} where it was", flush=True)
            return True
        return False

    async def _load(self, roles, path: Path) -> CoordinatorState:
        manifest = json.loads((path / MANIFEST).read_text())
        if (manifest["roles"].get("critic") is not None) != (roles.critic is not None):
            raise FailedPrecondition(f"run.resume: the checkpoint {path} was taken "
                                     f"{'with' if 'critic' in manifest['roles'] else 'without'} a critic; "
                                     f"algorithm {self.cfg.algorithm} runs {'with' if roles.critic else 'without'} one")
        try:
            state = read_state(path)
        except ValueError as exc:  # before any role loads anything
            raise FailedPrecondition(f"run.resume: {exc}") from None
        # Both answered before anything is concluded: a load still running must not land after the next one.
        actor, critic = await asyncio.gather(
            roles.actor.load_checkpoint(str(path / "actor")),
            roles.critic.load_checkpoint(str(path / "critic")) if roles.critic else _nothing(), return_exceptions=True)
        for failed in (actor, critic):
            if isinstance(failed, BaseException):
                raise failed
        for name, loaded in (("actor", actor), ("critic", critic)):
            if loaded is not None:
                _loaded_as_saved(name, loaded, manifest["roles"].get(name), path)
        log.warning("run.resume: continuing after step %d from %s (policy version %d)", state.step, path,
                    actor.model_version)
        return state

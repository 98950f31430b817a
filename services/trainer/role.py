"""The controller of a trainer role (the actor's and the critic's core): what both do alike.

A controller lives in the role's server process (rank 0) and owns no model: it validates requests,
keeps the step ledger and version fence with the model lock (`common/steps.TrainerState`), and
drives the role's workers (`common/workers.Workers`), this process's own among them. Checkpoints,
status and the weight digest are the same for both roles; a role adds its requests and, through
`after_load`, what else a loaded checkpoint must reach (the actor's rollout engines).
"""

from __future__ import annotations

from pathlib import Path

from rolefleet.common.modeling import release_memory
from rolefleet.common.role_types import CheckpointInfo, RoleStatus
from rolefleet.trainer import checkpoint
from rolefleet.trainer.steps import StepLedger, TrainerState
from rolefleet.trainer.worker import TrainingWorker
from rolefleet.trainer.workers import WorkerGroup, Workers


class TrainerRole:
    def __init__(self, role: str, worker: TrainingWorker, group: WorkerGroup | None, versioned: str):
        self.role = role
        self.worker = worker  # this process's (rank 0's)
        self.workers = Workers(worker, group)
        self.state = TrainerState(role, versioned)  # model lock, step ledger, model version
        self._lock = self.state.lock
        # Where SaveCheckpoint and LoadCheckpoint may read and write (serve sets the run's checkpoint.dir
        # and checkpoint.snapshot.dir); None: anywhere (a core used in-process).
        self.checkpoint_root = None
        self.snapshot_root = None

    @property
    def ledger(self) -> StepLedger:
        return self.state.ledger

    # --- checkpoints (trainer/checkpoint.py) ------------------------------------------------------

    def save_checkpoint(self, step: int, path: str, background: bool = False) -> CheckpointInfo:
        """The trainer's state as of `step` (its last applied one) into `path`; a repeat answers
        from disk. A snapshot (a path under `snapshot_root`) is complete once each rank copied its
        state into its snapshot files (`trainer/snapshot_file.py`): `background` (the coordinator's
        first request of a snapshot, answered once the state is off the device) asks for nothing more."""
        with self._lock:
            snapshot = checkpoint.is_snapshot(self, path)

            def prune() -> None:
                # Before writing a new snapshot (never on a repeat: the previous one stays until this
                # one's manifest): the coordinator asks for one at a time, after the previous one's
                # manifest, so only that one is still needed (two at most on this machine).
                if snapshot:
                    checkpoint.prune_snapshots(Path(self.snapshot_root), self.role, keep=1)

            # A snapshot is for resuming alone (never exported): no config or tokenizer files; its
            # buffer files beside the run's step directories (`<instance>/buffers/<role>`).
            buffers = str(self._snapshot_buffers(path)) if snapshot else None
            # A repeat of a snapshot may answer from a part an earlier process of this role wrote (a
            # step trained again after a recovery): the run may go back to it, so its file is kept.
            kept = (lambda: self.workers.run(TrainingWorker.keep_snapshot, path)) if snapshot else (lambda: None)
            return checkpoint.save_role(self, step, path, lambda work: self._save_state(work, buffers),
                                        (lambda work: None) if snapshot else self.write_hf_files, prune, kept)

    def _snapshot_buffers(self, path: str) -> Path:
        """Where this role's snapshot buffer files live: beside the run's step directories
        (`<instance>/buffers/<role>` for `<instance>/step-N/<role>`), within the snapshot root."""
        root = Path(self.snapshot_root).resolve()
        instance = Path(path).resolve().parent.parent
        return (instance if instance.is_relative_to(root) else root) / "buffers" / self.role

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        with self._lock:
            info = checkpoint.load_role(self, path, self._load_state)
            self.after_load(info)
            return info

    def training_ranks(self) -> int:
        """The ranks that train (and save and load the trainer's state)."""
        return len(self.workers.ranks(TrainingWorker.load_state))

    def _save_state(self, work: str, buffers: str | None) -> None:
        self.workers.run(TrainingWorker.save_state, work, buffers)

    def _load_state(self, path: str) -> None:
        self.workers.run(TrainingWorker.load_state, path)

    def write_hf_files(self, work) -> None:
        """What `rolefleet export` needs beside the weights (config, tokenizer)."""
        raise NotImplementedError

    def after_load(self, info: CheckpointInfo) -> None:
        """Under the model lock, after the trainer's state was loaded."""

    # --- status / lifecycle -----------------------------------------------------------------------

    def status(self, include_digest: bool = False) -> RoleStatus:
        """A snapshot read without the model lock (a request may be in flight); hashing the weights
        waits for the lock and is done only when asked."""
        return RoleStatus(self.role, self.state.version, self.ledger.last_step,
                          self.digest() if include_digest else "", broken=self.ledger.broken or "",
                          workers=self.workers.size, engine=self.rollout_engine())

    def rollout_engine(self) -> str:
        """The rollout engine generating now (the actor's); "" for a role without one."""
        return ""

    def digest(self) -> str:
        with self._lock:
            return self.workers.run(TrainingWorker.digest)

    def close(self) -> None:
        with self._lock:
            self.worker.close()
        release_memory()


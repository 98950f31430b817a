"""Checkpoints written behind the training (SaveCheckpoint with `background`; the coordinator's
per-step snapshots, DESIGN "Checkpoints").

A trainer rank stages its state, the tensors that `checkpoint.save_trainer` writes, into host
buffers kept from one save to the next (pinned on a GPU, so the copy runs on a stream of its own at
the link's speed), and torch.distributed.checkpoint's `async_save` writes the staged copy from a
thread while the next step runs. What must be ordered:

- the copy reads the weights and optimizer moments: nothing changes them before it is done (the
  trainer waits for it before an update or a load: `TrainerWrite.staged`);
- the buffers are reused: a save waits for the previous write before staging again;
- the ranks' writes meet in collectives (the plan, the metadata) from their writing threads: over a
  gloo group of the trainers' own, never the group the training's collectives use.

The role (rank 0) answers once every rank staged; the directory appears (`checkpoint.commit`) when
rank 0's write is done, which DCP finishes only after every rank's (`BackgroundSave`).
"""

from __future__ import annotations

import logging
import shutil
import threading
import warnings
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rolefleet.common.role_types import CheckpointInfo

log = logging.getLogger(__name__)

# A role of one process writes without torch.distributed, as meant; DCP warns so from its writing
# thread, where a `catch_warnings` of the caller's does not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class TrainerWrite:
    """One rank's save in flight: `staged` once its state is in the host buffers, `written` once
    its files (and, on the coordinating rank, the checkpoint's metadata) are."""

    staged: Future
    written: Future

    def wait_staged(self) -> None:
        """Until the state is off the device (a failed staging fails the write, reported there)."""
        wait([self.staged])

    def settle(self) -> None:
        """Until the write is over, however it ended (its failure is the role's to report)."""
        try:
            self.written.result()
        except BaseException:  # noqa: BLE001 - reported through BackgroundSave, not here
            pass


def make_stager():
    """Host buffers for a trainer's state, kept from one save to the next."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    # Staged from a thread (on its own stream on a GPU); pinned buffers copy at the link's speed.
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


_write_groups: dict = {}


def write_group(group):
    """A gloo group over `group`'s ranks (None: every rank) for the collectives of background
    writes, made once by those ranks alone; None outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group not in _write_groups:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        _write_groups[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _write_groups[group]


def start_write(state: dict, weights: Path, stager, group) -> TrainerWrite:
    """`state` (the trainer's model and optimizer state dicts) staged and written to `weights` in
    the background; collective over `group`'s ranks."""
    import torch.distributed.checkpoint as dcp

    if torch.cuda.is_available():
        # The staging stream does not wait for the step's last kernels (the optimizer's): they must be done.
        torch.cuda.current_stream().synchronize()
    response = dcp.async_save(state, checkpoint_id=str(weights), process_group=write_group(group),
                              async_stager=stager)
    return TrainerWrite(response.staging_completion, response.upload_completion)


class BackgroundSave:
    """A role's save whose state is staged and whose files are still being written: its directory
    is committed (or the partial one removed) when `written` (rank 0's write) ends; a repeat of the
    request waits for that (`wait`)."""

    def __init__(self, target: Path, step: int, info: CheckpointInfo, written: Future):
        from rolefleet.trainer.checkpoint import commit, partial

        self.target, self.step, self.info = target, step, info
        self.error: BaseException | None = None
        self._done = threading.Event()

        def finish(done: Future) -> None:
            try:
                done.result()
                shutil.rmtree(target, ignore_errors=True)  # a save of another step at the same path
                commit(target)
            except BaseException as exc:  # noqa: BLE001 - the write's failure is the repeat's answer
                self.error = exc
                shutil.rmtree(partial(target), ignore_errors=True)
                log.warning("writing the checkpoint %s failed: %s", target, exc)
            finally:
                self._done.set()

        written.add_done_callback(finish)

    def answers(self, step: int, path: str) -> bool:
        """Whether a request for (`step`, `path`) is this save's."""
        return step == self.step and Path(path).resolve() == self.target.resolve()

    def wait(self) -> CheckpointInfo:
        """Once the files are complete; a failed write is refused as a save that failed."""
        from rolefleet.common.errors import FailedPrecondition

        self._done.wait()
        if self.error is not None:
            raise FailedPrecondition(f"saving the checkpoint to {self.target} failed: {self.error}")
        return self.info

    def settle(self) -> None:
        self._done.wait()

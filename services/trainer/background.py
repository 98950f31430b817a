"""Checkpoints written behind the training (SaveCheckpoint with `background`; the coordinator's
per-step snapshots, DESIGN "Checkpoints").

A trainer rank stages its state, the tensors that `checkpoint.save_trainer` writes, into host
buffers kept from one save to the next (`HostCopy`: page-locked on a GPU, so the copy runs on a
stream of its own at the link's speed), and a thread of its own writes the staged copy with
torch.distributed.checkpoint while the next step runs. What must be ordered:

- the copy reads the weights and optimizer moments: nothing changes them before it is done (the
  trainer waits for it before an update or a load: `TrainerWrite.wait_staged`);
- the buffers are reused: a save waits for the previous write before staging again;
- the ranks' writes meet in collectives (the plan, the metadata) from their writing threads: over a
  gloo group of the trainers' own, never the group the training's collectives use.

The role (rank 0) answers once every rank staged; the directory appears (`checkpoint.commit`) when
rank 0's write is done, which DCP finishes only after every rank's (`BackgroundSave`).

Why not DCP's own `async_save` with its stagers: their staging is private API that changes between
releases, and in torch 2.11 its stager drops its buffers after every save and cannot stage a second
time (a state holding a class object fails with KeyError), which is the case this module exists for.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rolefleet.common.errors import FailedPrecondition
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
        wait([self.written])


class HostCopy:
    """A trainer's state dict copied into host buffers that are kept from one copy to the next (one
    per tensor, page-locked when it comes from a GPU), by a thread of its own that then writes it."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rolefleet-checkpoint-writer")

    def start(self, state: dict, write) -> TrainerWrite:
        """`state` staged, then `write(staged)`, in the writing thread."""
        if self.stream is not None:
            # The copy's stream does not wait for the step's last kernels (the optimizer's): they must be done.
            torch.cuda.current_stream().synchronize()
        staged: Future = Future()

        def stage_and_write():
            try:
                with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                    copied = self._copy("", state)
                if self.stream is not None:
                    self.stream.synchronize()
            except BaseException as exc:
                staged.set_exception(exc)
                raise
            staged.set_result(None)
            return write(copied)

        return TrainerWrite(staged, self.thread.submit(stage_and_write))

    def _copy(self, key: str, value):
        # DTensors exist only where a trainer shards; the coordinator imports this module (0.4 s to import).
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):  # its shard, with what DCP needs to place it in the whole
            local = self._host(key, value.to_local())
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                      stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._host(key, value)
        if isinstance(value, dict):
            return {k: self._copy(f"{key}/{k}", v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(f"{key}/{i}", v) for i, v in enumerate(value))
        return copy.deepcopy(value)  # settings (an optimizer's parameter groups)

    def _host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
            if tensor.is_cuda and buffer.nbytes:
                # Registered as it is, not from the pinned allocator, which rounds sizes up to a power of two.
                error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
                if error:  # (a locked-memory limit, say) the copy works all the same, at pageable speed
                    log.warning("page-locking the %d-byte staging buffer of %s failed (cudaError %d): the "
                                "snapshot's copy off the GPU goes through pageable memory", buffer.nbytes, key, error)
            self.buffers[key] = buffer
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return buffer


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


def _cpus() -> int:
    """The CPUs this process may run on (a container's cpuset, a `taskset`), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Threads writing one rank's files. A save the step waits for (a checkpoint) takes as many as help:
# one thread wrote 0.9 GiB/s on a 2-core machine (four: 1.8). A write behind the training (a
# snapshot) shares the process with the rollout engine's host-bound decode loop: on one H100 each
# step's generation lasted as long as the previous snapshot's write (docs/benchmarks.md), and on a
# 2-core machine a host-bound loop ran 1.02x its time alone beside one writing thread, 1.56x beside
# two, 4.5x beside eight (benchmarks/write_contention.py). It takes a quarter of the CPUs.
WRITE_THREADS = max(1, min(8, _cpus()))
BACKGROUND_WRITE_THREADS = max(1, min(8, _cpus() // 4))


def save(state: dict, weights: Path, process_group, threads: int = WRITE_THREADS) -> None:
    """`state` written to `weights` with torch.distributed.checkpoint, `threads` files at once."""
    import torch.distributed.checkpoint as dcp  # as trainer/checkpoint.py's: not for the coordinator

    writer = dcp.FileSystemWriter(str(weights), thread_count=threads)
    dcp.save(state, checkpoint_id=str(weights), storage_writer=writer, process_group=process_group)


def start_write(state: dict, weights: Path, host: HostCopy, group) -> TrainerWrite:
    """`state` (the trainer's model and optimizer state dicts) staged into `host` and written to
    `weights` in the background; collective over `group`'s ranks."""
    pg = write_group(group)  # made here, in the main thread, by every rank of the save at once
    return host.start(state, lambda staged: save(staged, weights, pg, BACKGROUND_WRITE_THREADS))


class BackgroundSave:
    """A role's save whose state is staged and whose files are still being written: its directory
    is committed (or the partial one removed) when `written` (rank 0's write) ends; a repeat of the
    request waits for that (`wait`)."""

    def __init__(self, target: Path, step: int, info: CheckpointInfo, written: Future):
        # import cycle: trainer/checkpoint.py imports this module
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
                log.warning("writing the checkpoint %s failed: %s: %s", target, type(exc).__name__, exc)
            finally:
                self._done.set()

        written.add_done_callback(finish)

    def answers(self, step: int, path: str) -> bool:
        """Whether a request for (`step`, `path`) is this save's."""
        return step == self.step and Path(path).resolve() == self.target.resolve()

    def wait(self) -> CheckpointInfo:
        """Once the files are complete; a failed write is refused as a save that failed."""
        self._done.wait()
        if self.error is not None:
            raise FailedPrecondition(f"saving the checkpoint to {self.target} failed: "
                                     f"{type(self.error).__name__}: {self.error}")
        return self.info

    def settle(self) -> None:
        self._done.wait()

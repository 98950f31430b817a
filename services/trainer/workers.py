"""A role over several worker processes (DESIGN "Process model"): a controller over SPMD workers.

Every rank of a role's group builds the role's worker (the process's share of the work: its
model, trainer, engine); rank 0, the role's server process, also builds the controller (validation,
ledger, locks), which drives the workers through `Workers.run(WorkerClass.method, *args)`. The
method is named by reference, never by a string: it is marked `@collective(part)`, the part of the
group it runs on (a part's ranks come from the worker's `parts`), and every rank of that part runs
it at once: an SPMD method that splits its work by rank and meets the other ranks in collectives
(`torch.distributed`: NCCL on CUDA, gloo on the CPU) of its own process group (`trainer/ranks.py`).

Commands travel on per-rank pipes, not in a collective, so that two parts can be driven at once
from two threads of rank 0 (the caller's locks keep any one rank's pipe to one thread at a time);
a command for a part without rank 0 returns the result of that part's first rank.

Failure: the result of a collective method must not depend on a rank, so an error that all ranks
raise alike (a refused step, a non-finite gradient) is an ordinary error on each. Any other error
in a worker, or a worker that dies, takes the group down: rank 0 logs which rank failed and exits
non-zero at once (collectives with a dead peer would wait forever).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from rolefleet.common.errors import RoleFleetError
from rolefleet.common.orphans import exit_with_parent

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

STOP = None
WATCH_PERIOD_S = 0.5
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective that waits longer means a rank is gone

PARTS = ("all", "trainers", "engines")  # the parts a worker's `parts` may name


def collective(part: str) -> Callable[[F], F]:
    """Mark a worker method as a collective one, run on `part` of the group (`Workers.run`)."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")

    def mark(method: F) -> F:
        method.__collective__ = part
        return method

    return mark


class Workers:
    """The controller's handle on its role's workers: `local` (this process's, rank 0's) and, over
    several processes, the others through `group`."""

    def __init__(self, local, group: WorkerGroup | None = None):
        self.local, self.group = local, group

    @property
    def size(self) -> int:
        return self.group.size if self.group is not None else 1

    def ranks(self, method: Callable) -> list[int]:
        part = getattr(method, "__collective__", None)
        if part is None:
            raise TypeError(f"{method.__qualname__} is not a collective method (mark it @collective(part))")
        return self.local.parts[part] if self.group is not None else [0]

    def run(self, method: Callable, *args):
        """`method(worker, *args)` on every rank of its part; the result of the part's first rank.

        A role error is raised alike on every rank of a part (they compute the same thing). Any other
        error on rank 0 may have left the workers inside a collective this rank never reached: the
        next command would pair with it, so the group is over and the role ends."""
        ranks = self.ranks(method)
        if self.group is None:
            return method(self.local, *args)
        return self.group.run(self.local, method, args, ranks)

    def here_alone(self, method: Callable) -> bool:
        """Whether `method`'s part is this process alone (its work may then stream from here)."""
        return self.ranks(method) == [0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, cpu_tensors: bool = False) -> None:
    """Join the role's process group. `cpu_tensors` (`<role>.offload=params`): collectives of CPU
    tensors too (FSDP's offloaded shards, gathered whole for the weight sync and the digest) go over
    gloo beside NCCL, which carries GPU tensors only."""
    if torch.cuda.is_available():
        backend = "cpu:gloo,cuda:nccl" if cpu_tensors else "nccl"
    else:
        backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)  # the group's GPUs are all visible; rank i drives the i-th
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


def offloads_params(role: str, raw_config: dict) -> bool:
    return (raw_config.get(role) or {}).get("offload") == "params"


def join_alone() -> None:
    """A process group of this process alone (a role of one worker) where there is none: FSDP2, whose
    CPU offload `<role>.offload=params` is, shards over a process group, and over one rank its
    collectives cost nothing."""
    if not dist.is_initialized():
        _init(0, 1, free_port(), cpu_tensors=True)


class WorkerGroup:
    """Rank 0's handle on its workers."""

    def __init__(self, role: str, processes: list[multiprocessing.Process], pipes: list):
        self.role = role
        self.processes = processes
        self._pipes = pipes  # rank r's command pipe is _pipes[r - 1]
        self._stopping = False
        self._watch = threading.Thread(target=self._watch_workers, name=f"{role}-workers", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, role: str, world: int, raw_config: dict, factory: Callable) -> WorkerGroup:
        """Spawn ranks 1..world-1 (each builds its worker with `factory(config)`, a function or
        class method found by name in the worker process) and join the group as rank 0."""
        port = free_port()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        pipes = [ctx.Pipe() for _ in range(1, world)]
        processes = [ctx.Process(target=worker_main, args=(role, factory, raw_config, rank, world, port, theirs),
                                 name=f"{role}-rank{rank}", daemon=False)
                     for rank, (_, theirs) in enumerate(pipes, start=1)]
        for p in processes:
            p.start()
        for _, theirs in pipes:
            theirs.close()  # only the worker holds its end: a dead worker reads as EOF here
        group = cls(role, processes, [ours for ours, _ in pipes])  # watching first: a worker that
        _init(0, world, port, offloads_params(role, raw_config))   # dies before joining ends the wait
        log.info("%s: %d worker processes joined (%s)", role, world, dist.get_backend())
        return group

    @property
    def size(self) -> int:
        """Worker processes, rank 0 included."""
        return len(self.processes) + 1

    def run(self, local, method: Callable, args: tuple, ranks: list[int]):
        """`method(worker, *args)` on `ranks`, rank 0's worker being `local`; see `Workers.run`."""
        ranks = sorted(ranks)
        workers = [r for r in ranks if r != 0]
        name = method.__qualname__
        try:
            for r in workers:
                self._pipes[r - 1].send((method, args, r == ranks[0]))
            refused, result = None, None
            if 0 in ranks:
                try:
                    result = method(local, *args)
                except RoleFleetError as exc:
                    refused = exc
            replies = {r: self._pipes[r - 1].recv() for r in workers}  # also: every rank is done
        except BaseException:
            self.fail(f"{name} failed on rank 0")
        if 0 not in ranks:
            result = replies[ranks[0]][1]
        # A role error: rank 0's, or a worker's (one that only some ranks raised is still an error).
        refused = refused or next((error for error, _ in replies.values() if error is not None), None)
        if refused is not None:
            raise refused
        return result

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        for pipe in self._pipes:
            try:
                pipe.send(STOP)
            except OSError as exc:  # a dead worker: nothing left to tell
                log.warning("%s: could not tell a worker to stop (%s)", self.role, exc)
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()

    def fail(self, what: str) -> NoReturn:
        """End the role: name the dead worker if there is one (a collective with it may be what
        failed here first), stop the others and exit 1; collectives with a dead rank would hang."""
        time.sleep(WATCH_PERIOD_S)  # a worker killed mid-collective: let its exit code arrive
        dead = [p for p in self.processes if p.exitcode is not None]
        for p in dead:
            log.error("%s: worker %s exited with code %s; the role cannot continue without it",
                      self.role, p.name, p.exitcode)
        if not dead:
            log.critical("%s: %s; ending the role", self.role, what, exc_info=True)
        for p in self.processes:
            if p.is_alive():
                p.kill()
        os._exit(1)

    def _watch_workers(self) -> None:
        while not self._stopping:
            if any(p.exitcode is not None for p in self.processes) and not self._stopping:
                self.fail("a worker exited")
            time.sleep(WATCH_PERIOD_S)


def worker_main(role: str, factory: Callable, raw_config: dict, rank: int, world: int, port: int, pipe) -> None:
    """Ranks 1..N-1: build the worker, then run each command from the pipe until STOP. The reply is
    (error, result): a role error raised here (alike on the part's every rank), and the result if
    this rank was asked for it."""
    from rolefleet.common.config import parse_config
    from rolefleet.trainer.threads import set_threads

    # Rank 0 killed (SIGKILL, the OOM killer): a rank inside a collective with it would otherwise
    # wait for COLLECTIVE_TIMEOUT, holding its GPU (and spinning it, on NCCL).
    exit_with_parent(1, f"{role} rank {rank}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(message)s")
    cfg = parse_config(raw_config, [])
    set_threads(getattr(cfg, role).num_threads)
    _init(rank, world, port, offloads_params(role, raw_config))
    worker = factory(cfg)
    while (command := pipe.recv()) is not STOP:
        method, args, answer = command
        try:
            result = method(worker, *args)
            pipe.send((None, result if answer else None))
        except RoleFleetError as exc:  # raised alike on every rank of the part
            log.info("%s refused on this rank too: %s", method.__qualname__, exc)
            pipe.send((exc, None))
        except Exception:
            log.exception("%s failed on rank %d; stopping the group", method.__qualname__, rank)
            os._exit(1)
    worker.close()  # a rank's own child processes (a vLLM engine) end with it
    dist.destroy_process_group()

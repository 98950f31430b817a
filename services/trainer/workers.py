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

A group may span nodes (`trainer/nodes.py`): then torch's elastic agent starts every node's
ranks (`launch.py`), rank 0 among them serves the role, and its commands travel to every
rank, on its node or another, over a gloo group of the process group itself (`GroupChannel`: the
same send/recv as a pipe). Rank 0 drives every rank alike, wherever it runs.

Failure: the result of a collective method must not depend on a rank, so an error that all ranks
raise alike (a refused step, a non-finite gradient) is an ordinary error on each. Any other error
in a worker, or a worker that dies, takes the group down: rank 0 logs which rank failed and exits
non-zero at once (collectives with a dead peer would wait forever). Over nodes, rank 0 holds a
pending receive from every rank on a second gloo group (`_Watch`): it fails the moment that
rank's process is gone, and the log names the rank's node.
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

from rolefleet.common.config import parse_config
from rolefleet.common.errors import RoleFleetError
from rolefleet.common.orphans import exit_with_parent
from rolefleet.trainer.nodes import NodeLayout
from rolefleet.trainer.threads import set_threads

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

STOP = None
WATCH_PERIOD_S = 0.5
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective that waits longer means a rank is gone
# A rank waits for its next command, and rank 0 for a rank's goodbye, as long as the role lives.
CONTROL_TIMEOUT = timedelta(days=30)
_layout = NodeLayout()  # this process's group, as `_init` joined it (`local_index`)
_address = "127.0.0.1"  # this node's address as the group's other nodes reach it (`node_address`)

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
    """A port free on loopback now (for a listener opened soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, store: dist.Store, layout: NodeLayout, cpu_tensors: bool = False) -> None:
    """Join the role's process group through rank 0's store. `cpu_tensors` (`<role>.offload=params`):
    collectives of CPU tensors too (FSDP's offloaded shards, gathered whole for the weight sync and
    the digest) go over gloo beside NCCL, which carries GPU tensors only."""
    global _layout
    if torch.cuda.is_available():
        backend = "cpu:gloo,cuda:nccl" if cpu_tensors else "nccl"
    else:
        backend = "gloo"
    _layout = layout
    if torch.cuda.is_available():
        torch.cuda.set_device(layout.local_index(rank))  # the node's GPUs are all visible; its i-th rank drives the i-th
    # The group's own store waits (a subgroup's first NCCL id, a barrier) get the collectives' time:
    # torch sets that on a store it makes itself, not on one it is given, which would keep the
    # rendezvous timeout (train.connect_timeout_s, 300 s) while a rank compiles its first update.
    store.set_timeout(COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


def join_group(role: str, rank: int, layout: NodeLayout, raw_config: dict, address: str) -> None:
    """A rank that torch's elastic agent started (`launch.py`): join the process group
    through the agent's store (MASTER_ADDR/PORT), at this rank's place in the layout, then the two
    gloo groups that carry rank 0's commands and watch every rank (made by every rank, in order)."""
    global _layout, _address, _control, _watch
    cpu_tensors = offloads_params(role, raw_config)
    if torch.cuda.is_available():
        backend = "cpu:gloo,cuda:nccl" if cpu_tensors else "nccl"
        torch.cuda.set_device(layout.local_index(rank))
    else:
        backend = "gloo"
    _layout, _address = layout, address
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=layout.world,
                            timeout=COLLECTIVE_TIMEOUT)
    _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _watch = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


_control = _watch = None  # the gloo groups of commands and of the watch (a group over nodes)


class GroupChannel:
    """A pipe's send/recv to one peer of the group, over the control group: rank 0's commands to a
    rank, the rank's replies. Only the group's own members are at its other end."""

    def __init__(self, peer: int):
        self.peer = peer

    def send(self, message) -> None:
        dist.send_object_list([message], dst=self.peer, group=_control)

    def recv(self):
        box = [None]
        dist.recv_object_list(box, src=self.peer, group=_control)
        return box[0]


def node_address() -> str:
    """Where this process's node is reached by the group's other nodes (loopback on one node)."""
    return _address


def local_index(rank: int) -> int:
    """The visible-device index of the GPU `rank` of this process's group drives (on its node)."""
    return _layout.local_index(rank) if rank < _layout.world else rank


def offloads_params(role: str, raw_config: dict) -> bool:
    return (raw_config.get(role) or {}).get("offload") == "params"


def join_alone() -> None:
    """A process group of this process alone (a role of one worker) where there is none: FSDP2, whose
    CPU offload `<role>.offload=params` is, shards over a process group, and over one rank its
    collectives cost nothing."""
    if not dist.is_initialized():
        _init(0, 1, dist.HashStore(), NodeLayout(), cpu_tensors=True)


class WorkerGroup:
    """Rank 0's handle on its workers: this node's as processes (one node), every rank's command channel."""

    def __init__(self, role: str, layout: NodeLayout, processes: list[multiprocessing.Process],
                 pipes: dict[int, object]):
        self.role, self.layout = role, layout
        self.processes = processes  # this node's other ranks, when this process started them
        self._pipes = pipes  # rank -> its command channel: a pipe, or a GroupChannel over nodes
        self._io = threading.Lock()  # guards _in_flight: commands sent whose replies are not read yet
        self._in_flight = 0
        self._stopping = False
        self._lost: str | None = None  # a rank of another process whose process is gone (over nodes)
        self._goodbyes: list[threading.Thread] = []
        self._watch = threading.Thread(target=self._watch_workers, name=f"{role}-workers", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, role: str, world: int, raw_config: dict, factory: Callable) -> WorkerGroup:
        """Spawn ranks 1..world-1 on this node (each builds its worker with `factory(config)`, a function
        or class method found by name in the worker process), host their store on loopback and join
        the group as rank 0."""
        layout = NodeLayout((world,))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        pipes = {rank: ctx.Pipe() for rank in range(1, world)}
        processes = [ctx.Process(target=worker_main, args=(role, factory, raw_config, rank, layout, store.port, theirs),
                                 name=f"{role}-rank{rank}", daemon=False)
                     for rank, (_, theirs) in pipes.items()]
        for p in processes:
            p.start()
        for _, theirs in pipes.values():
            theirs.close()  # only the worker holds its end: a dead worker reads as EOF here
        group = cls(role, layout, processes, {r: ours for r, (ours, _) in pipes.items()})
        _init(0, world, store, layout, offloads_params(role, raw_config))
        log.info("%s: %d worker processes joined (%s)", role, world, dist.get_backend())
        return group

    @classmethod
    def formed(cls, role: str, layout: NodeLayout) -> WorkerGroup:
        """Rank 0 of a group that torch's elastic agent (ours over nodes, or torchrun) started and
        `join_group` joined: its commands go over the control group, and every rank is watched."""
        group = cls(role, layout, [], {rank: GroupChannel(rank) for rank in range(1, layout.world)})
        for rank in range(1, layout.world):
            # A receive that completes on the rank's goodbye after STOP, and fails when its process is gone.
            work = dist.irecv(torch.zeros(1), src=rank, group=_watch)
            waiter = threading.Thread(target=group._await_goodbye, args=(rank, work), name=f"{role}-rank{rank}-watch",
                                      daemon=True)
            waiter.start()
            group._goodbyes.append(waiter)
        log.info("%s: %d worker processes joined (%s)%s", role, layout.world, dist.get_backend(),
                 f" over {layout.nodes} nodes" if layout.spans else "")
        return group

    def _await_goodbye(self, rank: int, work) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo's error for a closed connection: the rank is gone
            if not self._stopping:
                node = self.layout.node_of(rank)
                self._lost = f"{self.layout.describe(node)}: rank {rank}'s process is gone ({exc})"

    @property
    def size(self) -> int:
        """Worker processes, rank 0 included."""
        return self.layout.world

    def run(self, local, method: Callable, args: tuple, ranks: list[int]):
        """`method(worker, *args)` on `ranks`, rank 0's worker being `local`; see `Workers.run`."""
        ranks = sorted(ranks)
        workers = [r for r in ranks if r != 0]
        name, at = method.__qualname__, 0
        with self._io:
            self._in_flight += 1
        try:
            for at in workers:
                self._pipes[at].send((method, args, at == ranks[0]))
            refused, result = None, None
            if 0 in ranks:
                at = 0
                try:
                    result = method(local, *args)
                except RoleFleetError as exc:
                    refused = exc
            replies = {}
            for at in workers:  # also: every rank is done
                replies[at] = self._pipes[at].recv()
        except BaseException:
            self.fail(f"{name} failed on rank {at} ({self.layout.describe(self.layout.node_of(at))})")
        finally:
            with self._io:
                self._in_flight -= 1
        if 0 not in ranks:
            result = replies[ranks[0]][1]
        # A role error: rank 0's, or a worker's (one that only some ranks raised is still an error).
        refused = refused or next((error for error, _ in replies.values() if error is not None), None)
        if refused is not None:
            self._end_if_a_rank_is_gone(name)
            raise refused
        return result

    def _end_if_a_rank_is_gone(self, name: str) -> None:
        """A role error from a collective may be another rank's death seen first (a checkpoint save
        whose peer was killed): then the role ends as for any lost rank (its callers see it gone
        and recover) rather than answer as if the request were at fault."""
        time.sleep(WATCH_PERIOD_S)  # the death's exit code, or the lost connection, to arrive
        if self._lost is not None or any(p.exitcode is not None for p in self.processes):
            self.fail(f"{name} failed while a rank was lost")

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        for rank, pipe in self._pipes.items():
            try:
                pipe.send(STOP)
            except Exception as exc:  # noqa: BLE001 - a dead worker (a pipe's OSError, gloo's error): nothing to tell
                log.warning("%s: could not tell rank %d to stop (%s)", self.role, rank, exc)
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        for waiter in self._goodbyes:  # the other ranks' goodbyes: gone before their group goes
            waiter.join(timeout_s)
            if waiter.is_alive():
                log.warning("%s: %s did not say goodbye within %.0f s", self.role, waiter.name, timeout_s)
        dist.destroy_process_group()

    def abandon(self) -> None:
        """The group never formed: end this node's ranks."""
        self._stopping = True
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join(5)

    def fail(self, what: str) -> NoReturn:
        """End the role: name the dead worker or lost node if there is one (a collective with it may
        be what failed here first), stop the others and exit 1; collectives with a dead rank would
        hang. The other nodes' ranks lose rank 0 and end in turn, and so do their agents."""
        time.sleep(WATCH_PERIOD_S)  # a worker killed mid-collective: let its exit code arrive
        dead = [p for p in self.processes if p.exitcode is not None]
        for p in dead:
            log.error("%s: worker %s exited with code %s; the role cannot continue without it",
                      self.role, p.name, p.exitcode)
        lost = self._lost
        if lost is not None:
            log.error("%s: %s; the role cannot continue without it", self.role, lost)
        if not dead and lost is None:
            log.critical("%s: %s; ending the role", self.role, what, exc_info=True)
        for p in self.processes:
            if p.is_alive():
                p.kill()
        os._exit(1)

    def _watch_workers(self) -> None:
        while not self._stopping:
            if any(p.exitcode is not None for p in self.processes) and not self._stopping:
                self.fail("a worker exited")
            if self._lost is not None and not self._stopping:
                self.fail("a rank was lost")
            time.sleep(WATCH_PERIOD_S)


def worker_main(role: str, factory: Callable, raw_config: dict, rank: int, layout: NodeLayout, port: int,
                pipe) -> None:
    """Every rank but 0 of a group on one node: join rank 0's store on loopback, build the worker,
    then run rank 0's commands from `pipe` until STOP."""
    # The parent killed (SIGKILL, the OOM killer): a rank inside a collective with it would otherwise
    # wait for COLLECTIVE_TIMEOUT, holding its GPU (and spinning it, on NCCL).
    exit_with_parent(1, f"{role} rank {rank}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(message)s")
    cfg = parse_config(raw_config, [])
    set_threads(getattr(cfg, role).num_threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    _init(rank, layout.world, store, layout, offloads_params(role, raw_config))
    worker_loop(role, rank, factory(cfg), pipe)


def worker_loop(role: str, rank: int, worker, pipe=None) -> None:
    """Run rank 0's commands on this rank's `worker` until STOP. They come on `pipe` (one node) or
    over the control group (`GroupChannel`, a group over nodes, which also says goodbye on the
    watch group at the end). The reply is (error, result): a role error raised here (alike on the
    part's every rank), and the result if this rank was asked for it."""
    channel = pipe if pipe is not None else GroupChannel(0)
    while (command := channel.recv()) is not STOP:
        method, args, answer = command
        try:
            result = method(worker, *args)
            channel.send((None, result if answer else None))
        except RoleFleetError as exc:  # raised alike on every rank of the part
            log.info("%s refused on this rank too: %s", method.__qualname__, exc)
            channel.send((exc, None))
        except Exception:
            log.exception("%s failed on rank %d; stopping the group", method.__qualname__, rank)
            os._exit(1)
    worker.close()  # a rank's own child processes (a vLLM engine) end with it
    if pipe is None:
        dist.send(torch.ones(1), dst=0, group=_watch)  # rank 0's watch: stopped, not lost
    dist.destroy_process_group()

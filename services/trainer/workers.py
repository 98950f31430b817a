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

A group may span nodes (`trainer/nodes.py`): rank 0 hosts the group's rendezvous store
(`trainer/rendezvous.py`), a node process on each other node (`trainer/node.py`) starts that node's
ranks, which join the store and the process group and take their commands over a TCP connection
to rank 0 (the same send/recv as a pipe). Rank 0 drives every rank alike, wherever it runs.

Failure: the result of a collective method must not depend on a rank, so an error that all ranks
raise alike (a refused step, a non-finite gradient) is an ordinary error on each. Any other error
in a worker, or a worker that dies, takes the group down: rank 0 logs which rank failed and exits
non-zero at once (collectives with a dead peer would wait forever); so does another node whose
process reports a failed rank or stops its heartbeat, and the log names the node.
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
from rolefleet.trainer.nodes import NodeLayout
from rolefleet.trainer.rendezvous import (
    FirstNode,
    NodeWatch,
    Remote,
    Rendezvous,
    RendezvousError,
    connect_commands,
    host_store,
    join_store,
    own_address,
)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

STOP = None
WATCH_PERIOD_S = 0.5
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective that waits longer means a rank is gone
NODE_STALE_S = 30.0  # another node's heartbeat (every second) missing this long: its process or machine is gone
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


def _init(rank: int, world: int, store: dist.Store, layout: NodeLayout, cpu_tensors: bool = False,
          address: str = "127.0.0.1") -> None:
    """Join the role's process group through rank 0's store. `cpu_tensors` (`<role>.offload=params`):
    collectives of CPU tensors too (FSDP's offloaded shards, gathered whole for the weight sync and
    the digest) go over gloo beside NCCL, which carries GPU tensors only."""
    global _layout, _address
    if torch.cuda.is_available():
        backend = "cpu:gloo,cuda:nccl" if cpu_tensors else "nccl"
    else:
        backend = "gloo"
    _layout, _address = layout, address
    if torch.cuda.is_available():
        torch.cuda.set_device(layout.local_index(rank))  # the node's GPUs are all visible; its i-th rank drives the i-th
    # The group's own store waits (a subgroup's first NCCL id, a barrier) get the collectives' time:
    # torch sets that on a store it makes itself, not on one it is given, which would keep the
    # rendezvous timeout (train.connect_timeout_s, 300 s) while a rank compiles its first update.
    store.set_timeout(COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


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
    """Rank 0's handle on its workers: this node's as processes, every rank's command channel."""

    def __init__(self, role: str, layout: NodeLayout, processes: list[multiprocessing.Process],
                 pipes: dict[int, object], watch: NodeWatch | None = None):
        self.role, self.layout = role, layout
        self.processes = processes  # this node's other ranks
        self._pipes = pipes  # rank -> its command channel: a pipe here, a TCP connection on another node
        self._nodes = watch
        self._io = threading.Lock()  # guards _in_flight: commands sent whose replies are not read yet
        self._in_flight = 0
        self._stopping = False
        self._watch = threading.Thread(target=self._watch_workers, name=f"{role}-workers", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, role: str, world: int, raw_config: dict, factory: Callable, layout: NodeLayout | None = None,
              rdzv: Rendezvous | None = None) -> WorkerGroup:
        """Spawn this node's ranks 1..n-1 (each builds its worker with `factory(config)`, a function or
        class method found by name in the worker process), host the rendezvous, wait for the other
        nodes' ranks (`layout`) and join the group as rank 0. Raises RendezvousError when a node
        does not arrive within `rdzv.timeout_s`, naming it."""
        layout = layout or NodeLayout((world,))
        rdzv = rdzv or Rendezvous(role, "127.0.0.1", 0, COLLECTIVE_TIMEOUT.total_seconds())
        store = host_store(rdzv)
        rdzv = rdzv.at_port(store.port)
        first = FirstNode(rdzv, layout, store) if layout.spans else None
        here = Rendezvous(role, "127.0.0.1", store.port, rdzv.timeout_s, rdzv.secret)  # this node's ranks dial
        address = own_address(rdzv) if first else "127.0.0.1"  # ... and are reached at this node's address
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        pipes = {rank: ctx.Pipe() for rank in layout.ranks_of(0)[1:]}
        processes = [ctx.Process(target=worker_main, args=(role, factory, raw_config, rank, layout, here, theirs,
                                                           address),
                                 name=f"{role}-rank{rank}", daemon=False)
                     for rank, (_, theirs) in pipes.items()]
        for p in processes:
            p.start()
        for _, theirs in pipes.values():
            theirs.close()  # only the worker holds its end: a dead worker reads as EOF here
        watch = NodeWatch(rdzv, layout, NODE_STALE_S) if first else None
        group = cls(role, layout, processes, {r: ours for r, (ours, _) in pipes.items()}, watch)  # watching first:
        try:                                                      # a worker that dies before joining ends the wait
            if first is not None:
                first.wait_for_nodes()
                group._pipes.update(first.accept_ranks())
        except RendezvousError:
            group.abandon()
            raise
        _init(0, layout.world, store, layout, offloads_params(role, raw_config), address)
        log.info("%s: %d worker processes joined (%s)%s", role, layout.world, dist.get_backend(),
                 f" over {layout.nodes} nodes" if layout.spans else "")
        return group

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
            raise refused
        return result

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        for rank, pipe in self._pipes.items():
            try:
                pipe.send(STOP)
            except OSError as exc:  # a dead worker: nothing left to tell
                log.warning("%s: could not tell rank %d to stop (%s)", self.role, rank, exc)
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        for rank, pipe in self._pipes.items():  # the other nodes' ranks: gone before this store goes
            if isinstance(pipe, Remote) and not pipe.wait_closed(timeout_s):
                log.warning("%s: rank %d did not stop within %.0f s", self.role, rank, timeout_s)
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
        hang. The other nodes' processes see rank 0's store go and end their ranks in turn."""
        time.sleep(WATCH_PERIOD_S)  # a worker killed mid-collective: let its exit code arrive
        dead = [p for p in self.processes if p.exitcode is not None]
        for p in dead:
            log.error("%s: worker %s exited with code %s; the role cannot continue without it",
                      self.role, p.name, p.exitcode)
        lost = self._lost_node()
        if lost is not None:
            log.error("%s: %s; the role cannot continue without it", self.role, lost)
        if not dead and lost is None:
            log.critical("%s: %s; ending the role", self.role, what, exc_info=True)
        for p in self.processes:
            if p.is_alive():
                p.kill()
        os._exit(1)

    def _lost_node(self) -> str | None:
        if self._nodes is None:
            return None
        try:
            return self._nodes.problem() or self._hung_up()
        except Exception as exc:  # noqa: BLE001 - the store itself failing: report it, never hang here
            return f"the rendezvous store does not answer ({exc})"

    def _hung_up(self) -> str | None:
        """A rank on another node whose connection ended while no command was in flight (nothing
        else makes one readable then): its node process or the rank itself is gone. Found at once,
        where the heartbeat would take NODE_STALE_S."""
        with self._io:
            if self._in_flight:
                return None
            for rank, pipe in self._pipes.items():
                if isinstance(pipe, Remote) and pipe.readable():
                    node = self.layout.node_of(rank)
                    return f"{self.layout.describe(node)}: rank {rank}'s connection to rank 0 ended"
        return None

    def _watch_workers(self) -> None:
        while not self._stopping:
            if any(p.exitcode is not None for p in self.processes) and not self._stopping:
                self.fail("a worker exited")
            if self._lost_node() is not None and not self._stopping:
                self.fail("a node was lost")
            time.sleep(WATCH_PERIOD_S)


def worker_main(role: str, factory: Callable, raw_config: dict, rank: int, layout: NodeLayout, rdzv: Rendezvous,
                pipe=None, address: str = "127.0.0.1") -> None:
    """Every rank but 0: build the worker, then run each command until STOP. Commands come on `pipe`
    (a rank on rank 0's node) or, on another node, over a connection to rank 0 made here. The reply
    is (error, result): a role error raised here (alike on the part's every rank), and the result
    if this rank was asked for it. `address`: this node's, as the other nodes reach it."""
    from rolefleet.common.config import parse_config
    from rolefleet.trainer.threads import set_threads

    # The parent killed (SIGKILL, the OOM killer): a rank inside a collective with it would otherwise
    # wait for COLLECTIVE_TIMEOUT, holding its GPU (and spinning it, on NCCL).
    exit_with_parent(1, f"{role} rank {rank}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(message)s")
    cfg = parse_config(raw_config, [])
    set_threads(getattr(cfg, role).num_threads)
    store = join_store(rdzv, f"{role} rank {rank}")
    if pipe is None:
        pipe = connect_commands(rdzv, store, rank)
    _init(rank, layout.world, store, layout, offloads_params(role, raw_config), address)
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

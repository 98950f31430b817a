"""A role over several worker processes (DESIGN "Process model"): a single controller over SPMD
workers.

Rank 0 is the role's server process. `WorkerGroup.start` spawns ranks 1..N-1, each of which builds
the same core and then waits for commands on its own pipe. For a request, rank 0 validates it, then
`spmd(core, name, *args, ranks=...)` sends (name, args) to those ranks and every one of them, rank 0
included when listed, runs the core's method `name`: an SPMD method that splits its work by rank
and meets the other ranks in collectives (`torch.distributed`: NCCL on CUDA, gloo on the CPU).

Work groups: a core may split its ranks into parts that work at the same time (the actor's
trainers and its rollout engines, `actor/placement.py`). Each process then does its collectives in
its part's process group (`set_work_group`): `rank_and_world`, `all_gather`, the gradient
all-reduce and FSDP's mesh all speak of that part. Commands travel on per-rank pipes, not in a
collective, so that two parts can be driven at once from two threads of rank 0 (the caller's locks
keep any one rank's pipe to one thread at a time); a command for a part without rank 0 returns the
result of that part's first rank.

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
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from rolefleet.common.errors import RoleFleetError
from rolefleet.common.orphans import exit_with_parent

log = logging.getLogger(__name__)

STOP = None
WATCH_PERIOD_S = 0.5
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective that waits longer means a rank is gone

_work_group: dist.ProcessGroup | None = None  # this process's part of the group (None: the whole group)


def set_work_group(group: dist.ProcessGroup | None) -> None:
    """The process group this process's SPMD work meets in from now on (None: every rank)."""
    global _work_group
    _work_group = group


def work_group() -> dist.ProcessGroup | None:
    return _work_group


def new_subgroups(parts: list[list[int]]) -> list[dist.ProcessGroup | None]:
    """A process group per list of ranks. Every rank must call this with the same parts in the same
    order (creating a group is collective); a rank gets None for a group it is not in."""
    groups = []
    for ranks in parts:
        group = dist.new_group(sorted(ranks))
        groups.append(group if dist.get_rank() in ranks else None)
    return groups


def rank_and_world() -> tuple[int, int]:
    """This process's rank and size within its work group (0, 1 outside a group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(_work_group), dist.get_world_size(_work_group)
    return 0, 1


def work_mesh(device: torch.device):
    """The device mesh FSDP shards over: the work group's (None: the default, every rank)."""
    if _work_group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(_work_group, device.type)


def rank_slice(n: int) -> torch.Tensor:
    """Indices [0, n) this rank handles: a contiguous share, the first ranks one larger."""
    rank, world = rank_and_world()
    return torch.arange(n).tensor_split(world)[rank]


def all_gather(obj):
    """Every rank's `obj`, in rank order (a list of one on a single rank)."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=_work_group)
    return out


def sum_over_ranks(stats: dict) -> dict:
    """Per-key sums of every rank's statistics (tensors or floats; a rank may have none)."""
    rank, world = rank_and_world()
    if world == 1:
        return stats
    totals: dict[str, float] = {}
    for part in all_gather({k: float(v) for k, v in stats.items()}):
        for k, v in part.items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def my_share(items: list, lockstep: bool = False) -> list[tuple[object, bool]]:
    """(item, real) for this rank's every world-th item. `lockstep` (sharded weights: every pass is
    a collective): padded with throw-away repeats of the first item (real False) to the count of
    the busiest rank, so every rank runs as many passes."""
    rank, world = rank_and_world()
    mine = [(item, True) for item in items[rank::world]]
    if lockstep and items:
        mine += [(items[0], False)] * (-(-len(items) // world) - len(mine))
    return mine


def group_micro_batches(batch, max_tokens: int, packed: bool = False) -> list[torch.Tensor]:
    """The batch's micro-batches, as many as a multiple of the group's ranks where rows allow: with
    every world-th one each (`my_share`), the ranks get equal counts of similar sizes."""
    return batch.micro_batches(max_tokens, packed, multiple_of=rank_and_world()[1])


def map_micro_batches(batch, max_tokens: int, fn, packed: bool = False, lockstep: bool = False) -> tuple:
    """`SequenceBatch.map_micro_batches` over the group: each rank maps its share of the
    micro-batches (`my_share`) and every rank gets the whole result, in the batch's token order."""
    rank, world = rank_and_world()
    if world == 1:
        return batch.map_micro_batches(max_tokens, fn, packed)
    done = []
    for rows, real in my_share(group_micro_batches(batch, max_tokens, packed), lockstep):
        out = fn(batch.select(rows))
        if real:
            done.append((rows, out))
    return merge_over_ranks(batch, done)


def merge_over_ranks(batch, done: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> tuple:
    """Packed per-token tensors of the whole batch, in its token order, on every rank, from each
    rank's (rows, (packed tensors of those rows...)) for its share of the micro-batches."""
    done = [(rows, tuple(part.float().cpu() for part in parts)) for rows, parts in done]
    if rank_and_world()[1] > 1:
        done = [item for part in all_gather(done) for item in part]
    width = len(done[0][1]) if done else 0
    return tuple(batch.merge_rows([(rows, parts[i]) for rows, parts in done]) for i in range(width))


def spmd(core, name: str, *args, ranks: list[int] | None = None):
    """Run the core's SPMD method `name` on `ranks` of its group (default: every rank; just here
    without a group) and return its result (rank 0's, or the first listed rank's).

    A role error is raised alike on every rank of a part (they compute the same thing). Any other
    error on rank 0 may have left the workers inside a collective this rank never reached: the next
    command would pair with it, so the group is over and the role ends."""
    group = getattr(core, "group", None)
    if group is None:
        return getattr(core, name)(*args)
    return group.run(core, name, args, ranks)


def all_reduce_gradients(module: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the ranks (a rank that ran no micro-batch adds zeros),
    flattened into one buffer per dtype so the group makes one call, not one per parameter."""
    _, world = rank_and_world()
    if world == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in {p.grad.dtype for p in params}:
        grads = [p.grad for p in params if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=_work_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)  # the group's GPUs are all visible; rank i drives the i-th
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


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
    def start(cls, role: str, world: int, raw_config: dict) -> WorkerGroup:
        """Spawn ranks 1..world-1 (each builds its core with `serve.build_core(role, config)`) and
        join the group as rank 0."""
        port = free_port()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        pipes = [ctx.Pipe() for _ in range(1, world)]
        processes = [ctx.Process(target=worker_main, args=(role, raw_config, rank, world, port, theirs),
                                 name=f"{role}-rank{rank}", daemon=False)
                     for rank, (_, theirs) in enumerate(pipes, start=1)]
        for p in processes:
            p.start()
        for _, theirs in pipes:
            theirs.close()  # only the worker holds its end: a dead worker reads as EOF here
        group = cls(role, processes, [ours for ours, _ in pipes])  # watching first: a worker that
        _init(0, world, port)                                      # dies before joining ends the wait
        log.info("%s: %d worker processes joined (%s)", role, world, dist.get_backend())
        return group

    @property
    def size(self) -> int:
        """Worker processes, rank 0 included."""
        return len(self.processes) + 1

    def run(self, core, name: str, args: tuple, ranks: list[int] | None = None):
        """`core.<name>(*args)` on `ranks` (default: all); see `spmd`."""
        ranks = sorted(ranks) if ranks is not None else list(range(self.size))
        workers = [r for r in ranks if r != 0]
        try:
            for r in workers:
                self._pipes[r - 1].send((name, args, r == ranks[0]))
            refused, result = None, None
            if 0 in ranks:
                try:
                    result = getattr(core, name)(*args)
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
        set_work_group(None)
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


def worker_main(role: str, raw_config: dict, rank: int, world: int, port: int, pipe) -> None:
    """Ranks 1..N-1: build the core, then run each command from the pipe until STOP. The reply is
    (error, result): a role error raised here (alike on the part's every rank), and the result if
    this rank was asked for it."""
    from rolefleet.common.config import parse_config
    from rolefleet.common.server import set_threads
    from rolefleet.serve import build_core

    # Rank 0 killed (SIGKILL, the OOM killer): a rank inside a collective with it would otherwise
    # wait for COLLECTIVE_TIMEOUT, holding its GPU (and spinning it, on NCCL).
    exit_with_parent(1, f"{role} rank {rank}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(message)s")
    cfg = parse_config(raw_config, [])
    set_threads(getattr(cfg, role).num_threads)
    _init(rank, world, port)
    core = build_core(role, cfg)
    while (command := pipe.recv()) is not STOP:
        name, args, answer = command
        try:
            result = getattr(core, name)(*args)
            pipe.send((None, result if answer else None))
        except RoleFleetError as exc:  # raised alike on every rank of the part
            log.info("%s refused on this rank too: %s", name, exc)
            pipe.send((exc, None))
        except Exception:
            log.exception("%s failed on rank %d; stopping the group", name, rank)
            os._exit(1)
    if hasattr(core, "close"):
        core.close()  # a rank's own child processes (a vLLM engine) end with it
    dist.destroy_process_group()

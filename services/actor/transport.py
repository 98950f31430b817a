"""Weight transports: how the trainer's new weights reach the rollout engines after an update.

One transport per actor rank, chosen once from the placement (`choose`):

- `InPlace` (colocated: every rank trains and generates): each rank copies its trainer's weights
  (gathered, if sharded) into its own engine, which wakes from its sleep during the update.
- `Broadcast` (split, hf engines): the first trainer broadcasts the weights in buckets over the
  actor's torch.distributed sync group to the rollout ranks (`weight_sync.py`), which load each
  bucket into their engine as it arrives.
- `VllmLink` (split, vLLM engines in processes of their own): the first trainer sends over vLLM's
  NCCL weight transfer (`vllm_sync.py`) straight into the engines' workers; the link opens at the
  first sync.

`sync()` is collective over every rank of the actor (a sharded trainer's gather needs every
trainer). A new transport is one class here with its case in `choose`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rolefleet.actor import vllm_sync, weight_sync
from rolefleet.actor.placement import ActorPlacement
from rolefleet.actor.rollout import RolloutEngine
from rolefleet.trainer.workers import free_port, node_address

Shapes = list[tuple[str, tuple[int, ...]]]
Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]  # (name, full tensor), in the order of the shapes


@dataclass(frozen=True)
class Route:
    """Where weights travel from and to, and in what form."""
    placement: ActorPlacement
    rank: int  # this process's, in the actor's group
    shapes: Shapes  # what a sync carries, in order (full shapes)
    dtype: torch.dtype  # on the wire: the engines' (half the bytes of fp32)
    device: torch.device
    bucket_bytes: int  # `actor.rollout.sync_bucket_mb`
    group: dist.ProcessGroup | None  # the sync ranks' (split placement)

    @property
    def sender(self) -> int:
        return self.placement.train_ranks[0]


class WeightTransport(ABC):
    # Whether the engines generate on GPUs of their own, apart from training: a generation may then
    # run during an update, and a sync must wait for it; colocated, one lock covers both.
    apart = True

    def __init__(self, weights: Weights | None, engine: RolloutEngine | None, route: Route):
        """`weights`: this rank's trainer's weights for the engines (`PolicyTrainer.engine_weights`;
        None on a rollout rank); `engine`: its engine (None where the rank does not drive one)."""
        self.weights, self.engine, self.route = weights, engine, route

    @abstractmethod
    def sync(self) -> None:
        """Collective over the actor's ranks: the engines end up holding the trainer's weights."""

    def before_update(self) -> None:  # noqa: B027 - optional: most transports need no room made
        """On a training rank, before its update."""


class InPlace(WeightTransport):
    apart = False

    def before_update(self) -> None:
        self.engine.sleep()  # the trainer needs the memory more than the engine's caches

    def sync(self) -> None:
        self.engine.load_weights(self.weights())
        self.engine.reset_cache()
        self.engine.wake()


class _FromFirstTrainer(WeightTransport):
    """The split transports: the first training rank sends, the other trainers take part in the
    gather of sharded weights, each engine rank receives."""

    def sync(self) -> None:
        if self.weights is not None:
            named = self.weights()  # sharded: a gather every trainer takes part in
            if self.route.rank == self.route.sender:
                self.send(named)
            else:
                for _ in named:
                    pass
        elif self.engine is not None:  # else this rank's GPU serves another rank's engine
            self.receive()
            self.engine.reset_cache()

    @abstractmethod
    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    @abstractmethod
    def receive(self) -> None: ...


class Broadcast(_FromFirstTrainer):
    def send(self, named) -> None:
        r = self.route
        weight_sync.send(named, r.shapes, r.sender, r.group, r.dtype, r.device, r.bucket_bytes)

    def receive(self) -> None:
        r = self.route
        for part in weight_sync.receive(r.shapes, r.sender, r.group, r.dtype, r.device, r.bucket_bytes):
            self.engine.load_weights(part)


class VllmLink(_FromFirstTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sender: vllm_sync.Sender | None = None
        self._linked = False

    def sync(self) -> None:
        if not self._linked and self.route.rank in self.route.placement.sync_ranks:
            self._open()
        super().sync()

    def _open(self) -> None:
        """First sync, on the sync ranks: the sending trainer picks the port of the communicator and
        tells the rollout ranks; it and every engine's workers then join it, each from its own
        process at the same time (`vllm_sync.py`)."""
        r, rollout = self.route, self.route.placement.rollout_ranks
        # The sender's node address: the engines may be on other nodes of the actor's group.
        where = [(node_address(), free_port()) if r.rank == r.sender else None]
        dist.broadcast_object_list(where, src=r.sender, group=r.group)
        (address, port), world = where[0], 1 + len(rollout)  # the trainer and one engine worker per rollout GPU
        if r.rank == r.sender:
            self._sender = vllm_sync.Sender(address, port, world)
        elif self.engine is not None:
            self.engine.join_weight_transfer(vllm_sync.init_info(address, port, 1 + rollout.index(r.rank), world))
        self._linked = True

    def send(self, named) -> None:
        r = self.route
        self._sender.send(named, r.shapes, r.dtype, r.bucket_bytes)

    def receive(self) -> None:
        r = self.route
        self.engine.receive_weights(vllm_sync.update_info(r.shapes, r.dtype, r.bucket_bytes))


def choose(placement: ActorPlacement, backend: str) -> type[WeightTransport]:
    """The transport of an actor of this placement and rollout backend."""
    if not placement.split:
        return InPlace
    return VllmLink if backend == "vllm" else Broadcast

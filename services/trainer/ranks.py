"""A process's part of its role's worker group: the ranks it meets in collectives.

A worker owns one `Ranks` and hands it to what it builds (the trainer, FSDP's mesh, the compile
counter): nothing reads a process-wide group, so a role that splits its ranks into parts working at
the same time (the actor's trainers and its rollout workers, `actor/placement.py`) cannot have a
collective of one part meet in the other's group by accident. `Ranks.alone()` is a role of one
process: every method below is then the single-process computation, with no collective at all.

The micro-batch helpers split a batch's work over the part: each rank takes every world-th
micro-batch (`share`), and with sharded weights (every forward and backward is a collective) the
ranks run in lockstep, a rank with fewer real micro-batches padding with throw-away passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Ranks:
    rank: int = 0  # within the part
    world: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (every rank of the role)

    @classmethod
    def alone(cls) -> Ranks:
        return cls()

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Ranks:
        """This process's place in `group` (None: the whole role; a role of one process outside a
        process group)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def first(self) -> bool:
        return self.rank == 0

    def mesh(self, device: torch.device):
        """The device mesh FSDP shards over: the part's (None: FSDP's default, every rank)."""
        if self.group is None:
            return None
        return DeviceMesh.from_group(self.group, device.type)

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (a list of one alone)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def sum_stats(self, stats: dict) -> dict[str, float]:
        """Per-key sums of every rank's statistics (tensors or floats; a rank may lack a key), as
        floats: read from the device in one transfer, not one per statistic."""
        if not stats:
            mine: dict[str, float] = {}
        else:
            values = [torch.as_tensor(v).detach().float().reshape(()) for v in stats.values()]
            device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
            mine = dict(zip(stats, torch.stack([v.to(device) for v in values]).tolist()))
        if self.world == 1:
            return mine
        totals: dict[str, float] = {}
        for part in self.all_gather(mine):
            for k, v in part.items():
                totals[k] = totals.get(k, 0.0) + v
        return totals

    def slice(self, n: int) -> torch.Tensor:
        """Indices [0, n) this rank handles: a contiguous share, the first ranks one larger."""
        return torch.arange(n).tensor_split(self.world)[self.rank]

    def share(self, items: list, lockstep: bool = False) -> list[tuple[object, bool]]:
        """(item, real) for this rank's every world-th item. `lockstep` (sharded weights: every pass is
        a collective): padded with throw-away repeats of the first item (real False) to the count of
        the busiest rank, so every rank runs as many passes."""
        mine = [(item, True) for item in items[self.rank::self.world]]
        if lockstep and items:
            mine += [(items[0], False)] * (-(-len(items) // self.world) - len(mine))
        return mine

    def micro_batches(self, batch, max_tokens: int, packed: bool = False) -> list[torch.Tensor]:
        """The batch's micro-batches, as many as a multiple of the part's ranks where rows allow: with
        every world-th one each (`share`), the ranks get equal counts of similar sizes."""
        return batch.micro_batches(max_tokens, packed, multiple_of=self.world)

    def map_micro_batches(self, batch, max_tokens: int, fn: Callable, packed: bool = False,
                          lockstep: bool = False) -> tuple:
        """`SequenceBatch.map_micro_batches` over the part: each rank maps its share of the
        micro-batches and every rank gets the whole result, in the batch's token order."""
        if self.world == 1:
            return batch.map_micro_batches(max_tokens, fn, packed)
        done = []
        for rows, real in self.share(self.micro_batches(batch, max_tokens, packed), lockstep):
            out = fn(batch.select(rows))
            if real:
                done.append((rows, out))
        return self.merge(batch, done)

    def merge(self, batch, done: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> tuple:
        """Packed per-token tensors of the whole batch, in its token order, on every rank, from each
        rank's (rows, (packed tensors of those rows...)) for its share of the micro-batches."""
        done = [(rows, tuple(part.float().cpu() for part in parts)) for rows, parts in done]
        if self.world > 1:
            done = [item for part in self.all_gather(done) for item in part]
        width = len(done[0][1]) if done else 0
        return tuple(batch.merge_rows([(rows, parts[i]) for rows, parts in done]) for i in range(width))

    def all_reduce_gradients(self, module: torch.nn.Module) -> None:
        """Sum every parameter's gradient over the ranks (a rank that ran no micro-batch adds zeros),
        flattened into one buffer per dtype so the part makes one call, not one per parameter."""
        if self.world == 1:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in {p.grad.dtype for p in params}:
            grads = [p.grad for p in params if p.grad.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))


def new_subgroups(parts: list[list[int]]) -> list[dist.ProcessGroup | None]:
    """A process group per list of ranks. Every rank must call this with the same parts in the same
    order (creating a group is collective); a rank gets None for a group it is not in."""
    groups = []
    for ranks in parts:
        group = dist.new_group(sorted(ranks))
        groups.append(group if dist.get_rank() in ranks else None)
    return groups


def global_rank() -> int:
    """This process's rank in its role (0 for a role of one process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def global_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

"""Weights from the actor's trainers to its rollout workers on other GPUs (split placement).

After every update the first training rank broadcasts the full weights (gathered from the FSDP
shards, which every training rank takes part in) to the rollout ranks in the engine's dtype, a
bucket of parameters at a time: one broadcast per bucket instead of one per parameter (hundreds of
small NCCL calls), and a bounded extra buffer instead of a second copy of the model. The rollout
ranks unflatten each bucket into views and load them into their engines as they arrive.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist


def plan_buckets(sizes: list[int], bucket_elements: int) -> list[list[int]]:
    """Consecutive parameter indices grouped so that each group holds at most `bucket_elements`
    elements; a parameter larger than that is a bucket of its own."""
    buckets: list[list[int]] = []
    filled = bucket_elements  # start a bucket with the first parameter
    for i, size in enumerate(sizes):
        if filled + size > bucket_elements:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += size
    return buckets


def send(named: Iterable[tuple[str, torch.Tensor]], shapes: list[tuple[str, tuple[int, ...]]], src: int,
         group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device, bucket_bytes: int) -> None:
    """On the sending rank: broadcast `named` (in the order of `shapes`, which the receivers hold
    too) bucket by bucket. `named` may be a lazy gather: it is consumed once, in order."""
    source = iter(named)
    for bucket in plan_buckets([_numel(s) for _, s in shapes], _elements(bucket_bytes, dtype)):
        parts = []
        for i in bucket:
            name, tensor = next(source)
            if name != shapes[i][0]:
                raise RuntimeError(f"weight sync: expected {shapes[i][0]}, the trainer gave {name}")
            parts.append(tensor.detach().to(device=device, dtype=dtype).reshape(-1))
        flat = torch.cat(parts)
        dist.broadcast(flat, src=src, group=group)


def receive(shapes: list[tuple[str, tuple[int, ...]]], src: int, group: dist.ProcessGroup, dtype: torch.dtype,
            device: torch.device, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """On a receiving rank: each bucket's (name, tensor) views as it arrives."""
    sizes = [_numel(s) for _, s in shapes]
    for bucket in plan_buckets(sizes, _elements(bucket_bytes, dtype)):
        flat = torch.empty(sum(sizes[i] for i in bucket), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        views = flat.split([sizes[i] for i in bucket])
        yield [(shapes[i][0], view.view(shapes[i][1])) for i, view in zip(bucket, views)]


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _elements(bucket_bytes: int, dtype: torch.dtype) -> int:
    return max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())

"""Weights from the actor's first trainer straight into vLLM engines on other GPUs (split placement,
`actor.rollout.backend=vllm`).

A split actor's vLLM engines run in processes of their own: an engine inside a worker of the actor
group would take that group's torch.distributed world for its own. The weights therefore travel
through vLLM's weight-transfer API with its NCCL backend. At the first sync the sending trainer
(rank 0 of a new communicator) and every engine worker (engine e's from 1 + e * GPUs per engine)
join one NCCL communicator; each sync then broadcasts the weights in the engines' dtype, packed
into buckets of `actor.rollout.sync_bucket_mb`, and the engines load each bucket as it arrives.
Bucket size, names, shapes and dtype must agree on both ends: `update_info` states them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def init_info(address: str, port: int, rank_offset: int, world: int) -> dict:
    """What an engine needs to join the communicator: the sender's address (its node's, when the
    actor spans nodes), its first worker's rank in it and its size."""
    return {"master_address": address, "master_port": port, "rank_offset": rank_offset, "world_size": world}


def update_info(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int) -> dict:
    """What the engines expect in one sync, in the sender's order."""
    return {"names": [name for name, _ in shapes], "dtype_names": [str(dtype).removeprefix("torch.")] * len(shapes),
            "shapes": [list(shape) for _, shape in shapes], "packed": True, "packed_buffer_size_bytes": bucket_bytes}


class Sender:
    """The trainer's end: opens the communicator (blocking until every engine worker has joined)."""

    def __init__(self, address: str, port: int, world: int):
        # optional dependency: vllm
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self._transfer = NCCLWeightTransferEngine
        self.group = NCCLWeightTransferEngine.trainer_init({"master_address": address, "master_port": port,
                                                            "world_size": world})

    def send(self, named: Iterable[tuple[str, torch.Tensor]], shapes: list[tuple[str, tuple[int, ...]]],
             dtype: torch.dtype, bucket_bytes: int) -> None:
        """Broadcast `named` (a lazy gather is fine: consumed once, in order) while the engines run
        their `update_weights` with `update_info(shapes, dtype, bucket_bytes)`."""
        self._transfer.trainer_send_weights(_in_order(named, shapes), {
            "group": self.group, "packed": True, "packed_buffer_size_bytes": bucket_bytes,
            "post_iter_func": lambda item: item[1].detach().to(dtype)})
        torch.cuda.synchronize()  # the last bucket's broadcast runs on a side stream


def _in_order(named: Iterable[tuple[str, torch.Tensor]],
              shapes: list[tuple[str, tuple[int, ...]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The receivers unpack by the names they were told: a trainer that yields another order or
    count would load tensors under the wrong names, so it fails here instead."""
    source = iter(named)
    for expected, shape in shapes:
        name, tensor = next(source, (None, None))
        if name != expected or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(f"weight sync: expected {expected} {tuple(shape)}, the trainer gave "
                               f"{name} {None if tensor is None else tuple(tensor.shape)}")
        yield name, tensor

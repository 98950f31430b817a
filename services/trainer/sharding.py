"""Sharded data parallelism (FSDP2) for a trainer over its role's worker group.

With several workers and `<role>.sharding: fsdp`, every decoder layer and the model's root
(embeddings, final norm, heads) become FSDP units: each rank keeps 1/world of every parameter, of
its gradient and of its optimizer state; a unit gathers its full parameters for its forward and its
backward and frees them after; gradients are reduce-scattered. On CUDA the gathered parameters are
bf16 and gradients are reduced in fp32 (the mixed precision of the one-GPU path, where autocast
casts fp32 master weights).

What it asks of the callers, since every gather is a collective:
- lockstep: every rank runs as many forwards and backwards as every other (`Ranks.share`
  pads a rank's share of micro-batches with throw-away passes);
- the root's parameters are gathered by the root's own forward hook, so trainers call the whole
  module (`actor.trainer.LogprobModule`, the critic's `ValueModel`), never a part of it alone;
- full tensors (`full_named_parameters`: the rollout engine's weights, the digest) are gathered on
  every rank at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rolefleet.trainer.loading import materialize
from rolefleet.trainer.ranks import Ranks


def sharding_wanted(cfg, ranks: Ranks) -> bool:
    """Whether a trainer of this section shards: when asked for and there is more than one worker
    to shard over, or to keep its parameters in host memory (FSDP's CPU offload, one worker too)."""
    return (cfg.sharding == "fsdp" and ranks.world > 1) or cfg.offload == "params"


def shard(root: torch.nn.Module, layers: list[torch.nn.Module], device: torch.device, dtype: torch.dtype | None,
          ranks: Ranks, offload: bool = False, full_precision: tuple[torch.nn.Module, ...] = ()) -> None:
    """FSDP2 over the group: each of `layers` a unit, `root` (holding them) the outer one.
    `dtype`: the compute dtype of the gathered parameters (None: as stored); `full_precision`:
    units gathered as stored whatever `dtype` (a value head); `offload`: the shards live in CPU
    memory (for a frozen reference model) and visit the GPU per forward."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    where = CPUOffloadPolicy() if offload and device.type == "cuda" else OffloadPolicy()
    mesh = ranks.mesh(device)  # the ranks that train (the actor's rollout ranks hold no shards)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=where)
    for module in full_precision:
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(), offload_policy=where)
    fully_shard(root, mesh=mesh, mp_policy=policy, offload_policy=where)
    # A model built on the meta device gets its weights now, each rank its shards (where FSDP keeps them).
    materialize(root, torch.device("cpu") if isinstance(where, CPUOffloadPolicy) else device)


def full_named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter; on a sharded module each is gathered from every rank
    (a collective: all ranks iterate together)."""
    for name, param in module.named_parameters():
        yield name, full_tensor(param)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor; of a sharded one a collective over its ranks."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def loss_scale(sharded: bool, ranks: Ranks) -> float:
    """The factor on a rank's share of the loss: FSDP averages the ranks' gradients where the
    trainers' shares are meant to add up (the replicated path sums them, `all_reduce_gradients`)."""
    return float(ranks.world) if sharded else 1.0


def reduce_gradients(module: torch.nn.Module, sharded: bool, ranks: Ranks) -> None:
    """After the last backward of a step: sum the replicas' gradients (a sharded module's were
    reduce-scattered in its backward already)."""
    if not sharded:
        ranks.all_reduce_gradients(module)

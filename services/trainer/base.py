"""The trainer of a trainer role on one worker rank: what the policy and the value trainer share.

A trainer owns its model's optimizer side: precision, sharding (FSDP2) or replication over its
part of the group, activation checkpointing, compiled layers, the optimizer and its schedule, the
mini-batch generator, and its checkpointed state. One optimizer step (`optimizer_step`) is the same
for every loss:

1. the mini-batch's micro-batches of at most `max_tokens_per_micro_batch` padded tokens, every
   world-th one on this rank (in lockstep when sharded: a rank short of micro-batches runs
   throw-away passes with share 0, since every forward and backward then is a collective);
2. each micro-batch's loss, scaled by its share of the mini-batch (the shares of all ranks add up
   to one: the step equals one over the whole mini-batch), backward;
3. gradients summed over the replicas (sharded: reduce-scattered in the backward already), the
   statistics summed over the ranks in one transfer, clipped and applied (a non-finite gradient
   never is: `optim.apply_gradients`).

Statistics stay on the device until the step is done. A subclass gives only its forward and its
loss: the micro-batches' shares (how its loss aggregates over tokens) and the loss of one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rolefleet.common import packed_attention
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.modeling import (
    autocast,
    compile_decoder_layers,
    compute_dtype,
    decoder_layers,
    enable_activation_checkpointing,
    weights_digest,
)
from rolefleet.trainer import checkpoint
from rolefleet.trainer.optim import HostOptimizerState, StepFn, apply_gradients, make_optimizer, run_epochs
from rolefleet.trainer.ranks import Ranks
from rolefleet.trainer.sharding import loss_scale, reduce_gradients, shard, sharding_wanted
from rolefleet.trainer.snapshot_file import SnapshotBuffers

# The loss of one micro-batch (its rows of the mini-batch; `real` False for a throw-away pass) and
# its statistics as device tensors, which the step weighs by the micro-batch's share.
MicroLoss = Callable[[torch.Tensor, bool], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def shape_families(packed: bool, attention: str = "sdpa") -> list[SequenceBatch]:
    """One tiny micro-batch of each shape family a compiled decoder layer needs a graph of. Padded:
    rows with padding (an attention mask); one row, and rows of one length (no mask: transformers
    drops an all-ones one, and a batch of one is a size torch.compile specialises on). Packed: one
    row without a mask, always, and under `auto` attention also one large enough for the block
    mask (`packed_attention.flex_for`). And a single response token (the LM head's rows:
    torch.compile specialises sizes 0 and 1), the other lengths above 1."""
    def rows(*shapes: tuple[int, int]) -> SequenceBatch:
        return SequenceBatch.from_lists([torch.full((p,), 3) for p, _ in shapes], [torch.full((r,), 3) for _, r in shapes])

    if packed:
        # Many short sequences, not one long one: no position past a short-context model's limit.
        count = -(-packed_attention.AUTO_FLEX_MIN_TOKENS // 256)
        large = [rows(*[(250, 6)] * count)] if attention == "auto" else []
        families = [rows((4, 5), (3, 6)), rows((3, 1)), *large]
        # Each again with its token count a multiple of 8 (and the other way round): on CUDA the
        # kernels' graphs are guarded on the sizes' alignment, another graph each side.
        return families + [rows((4, 4), (3, 5)), rows((7, 1))]
    return [rows((5, 3), (4, 6)), rows((4, 5)), rows((4, 5), (4, 5)), rows((3, 1)),
            rows((9, 3), (8, 8)), rows((8, 8)), rows((8, 8), (8, 8)), rows((7, 1))]  # widths of 8s


class Trainer:
    stat_prefix = ""  # before the step's `loss`, `lr` and `grad_norm` statistics (the critic's: "vf_")

    def __init__(self, model: torch.nn.Module, root: torch.nn.Module, backbone, cfg, device: torch.device,
                 ranks: Ranks, seed: int, full_precision: tuple[torch.nn.Module, ...] = ()):
        """`model`: what is trained, saved and digested; `root`: the module whose forward the losses
        call, holding `model`'s parameters (sharded, its forward hook gathers the root unit's);
        `backbone`: the transformers model whose decoder layers are the units of sharding,
        checkpointing and compiling; `full_precision`: parts kept in fp32 when sharded (a value head)."""
        self.model, self.root, self.cfg, self.device, self.ranks = model, root, cfg, device, ranks
        self.packed = cfg.sequence_packing  # micro-batches as one row each (see SequenceBatch.packed_inputs)
        self.attention = packed_attention.resolve(cfg.packed_attention, device)  # ... and their attention
        self.dtype = compute_dtype(device, cfg.compute_dtype)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(backbone)
        # Several workers: FSDP shards (cfg.sharding) or replicas; every pass in lockstep if sharded.
        # Parameters in host memory are FSDP's CPU offload, over however many workers (one included).
        self.sharded = sharding_wanted(cfg, ranks)
        if self.sharded:
            shard(root, decoder_layers(backbone), device, self.dtype, ranks, offload=cfg.offload == "params",
                  full_precision=full_precision)
        if cfg.compile_layers:
            compile_decoder_layers(backbone, hooks_outside=self.sharded)
        self.optimizer, self.scheduler = make_optimizer(root, cfg)  # over the shards, if sharded
        self.state_offload = HostOptimizerState(self.optimizer) if cfg.offload == "optimizer" else None
        self.generator = torch.Generator().manual_seed(seed)
        self._snapshots = SnapshotBuffers()  # this rank's snapshot files, mapped from one snapshot to the next

    # --- passes over a batch ------------------------------------------------------------------

    def warm_compile(self, passes: list[tuple[bool, Callable[[SequenceBatch], torch.Tensor]]]) -> None:
        """With `compile_layers`, compile now, before the first step, a graph for every shape family
        a micro-batch of this trainer can take (`shape_families`), for each kind of pass it runs
        (`passes`: with gradients or not, and the forward), so that no step stalls on a compile
        later (`compile/graphs` after warm-up; docs/metrics.md). Every rank runs the same passes, in
        lockstep where sharded; the gradients they leave are dropped."""
        if not (self.cfg.compile_layers and self.cfg.compile_warmup):
            return
        for grad, forward in passes:
            self.model.train(grad)  # the update's mode, or the logprob passes' (a guard of their graphs)
            for mb in shape_families(self.packed, self.attention):
                with torch.set_grad_enabled(grad), self.autocast():
                    out = forward(mb)
                if grad:
                    out.float().sum().backward()
        self.model.eval()
        self.model.zero_grad(set_to_none=True)

    def autocast(self):
        return autocast(self.device, self.dtype)

    def map_micro_batches(self, batch: SequenceBatch, fn: Callable[[SequenceBatch], tuple]) -> tuple:
        """`fn` over the batch's micro-batches (no gradients), each rank its share, every rank the
        whole result in the batch's token order."""
        with torch.no_grad(), self.autocast():
            return self.ranks.map_micro_batches(batch, self.cfg.max_tokens_per_micro_batch, fn, self.packed,
                                                self.sharded)

    def micro_batches(self, mb: SequenceBatch) -> list[torch.Tensor]:
        """The rows of each of the mini-batch's micro-batches, over the whole part."""
        return self.ranks.micro_batches(mb, self.cfg.max_tokens_per_micro_batch, self.packed)

    def run_epochs(self, batch: SequenceBatch, step: StepFn) -> dict[str, float]:
        """`step` once per mini-batch per epoch, the model in training mode; each statistic averaged
        over the optimizer steps (`optim.run_epochs`: a failure after the first is a PartialUpdate)."""
        self.model.train()
        try:
            return run_epochs(batch, self.cfg.ppo_epochs, self.cfg.num_mini_batches, self.generator, step)
        finally:
            self.model.eval()

    def optimizer_step(self, micro: list[tuple[torch.Tensor, float]], micro_loss: MicroLoss,
                       stats: dict | None = None) -> dict[str, float]:
        """One optimizer step over a mini-batch: `micro` holds (rows, share) of each of its
        micro-batches over the whole part (`micro_batches`); this rank runs its every world-th one.
        `stats`: the step's statistics so far (mini-batch-wide ones, which `micro_loss` may add to);
        each micro-batch's own are added in, weighted by its share. Two host syncs in all: the sum
        over the ranks and the gradient norm."""
        stats = {} if stats is None else stats
        self.optimizer.zero_grad(set_to_none=True)
        scale = loss_scale(self.sharded, self.ranks)
        for (rows, share), real in self.ranks.share(micro, self.sharded):
            share = share if real else 0.0
            loss, micro_stats = micro_loss(rows, real)  # its forward under `self.autocast()`
            (loss * (share * scale)).backward()
            for name, value in micro_stats.items():
                stats[name] = stats.get(name, 0.0) + value * share
        reduce_gradients(self.root, self.sharded, self.ranks)
        totals = self.ranks.sum_stats(stats)
        p = self.stat_prefix
        lr = self.optimizer.param_groups[0]["lr"]  # the rate of this step (the scheduler moves it on)
        grad_norm = apply_gradients(self.root, self.optimizer, self.cfg.max_grad_norm, totals[f"{p}loss"],
                                    self.scheduler, self.state_offload and self.state_offload.step)
        # Applied: the gradients are of no more use, and generation and the next forwards want the memory.
        self.optimizer.zero_grad(set_to_none=True)
        return {**totals, f"{p}lr": lr, f"{p}grad_norm": grad_norm}

    # --- state ----------------------------------------------------------------------------------

    def save_state(self, work: Path, buffers: Path | None = None) -> None:
        """Collective over the part: each rank its shards; the first the scheduler and RNG states.
        `buffers`: a snapshot, copied into this rank's snapshot files in that directory
        (`trainer/snapshot_file.py`)."""
        checkpoint.save_trainer(work, self.model, self.optimizer, self.scheduler, self.generator, self.ranks,
                                None if buffers is None else (self._snapshots, buffers))

    def load_state(self, path: Path) -> None:
        """The inverse of `save_state`, resharded to this part (a snapshot: onto the same shards)."""
        checkpoint.load_trainer(path, self.model, self.optimizer, self.scheduler, self.generator, self.ranks)
        self.keep_snapshot(path)
        if self.state_offload is not None:
            self.state_offload.to_host()  # loading put the state beside the parameters

    def keep_snapshot(self, path: Path) -> None:
        """The snapshot at `path` (loaded, or answered from disk to a repeated request) is one the
        run may go back to: the next snapshot leaves its file alone."""
        self._snapshots.keep(path / "weights", self.ranks.rank)

    def digest(self) -> str:
        """Collective when sharded: the weights are gathered on every rank."""
        return weights_digest(self.model)

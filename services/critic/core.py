"""CriticCore: value predictions and value-loss updates, without gRPC."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rolefleet.algos import VALUE_LOSSES
from rolefleet.common import checkpoint, metrics
from rolefleet.common.batch import BatchLimits, SequenceBatch
from rolefleet.common.config import CriticSection
from rolefleet.common.modeling import (
    autocast,
    compile_decoder_layers,
    compute_dtype,
    decoder_layers,
    enable_activation_checkpointing,
    pick_device,
    release_memory,
    weights_digest,
)
from rolefleet.common.profiling import NewGraphs, profiled
from rolefleet.common.role_types import CheckpointInfo, RoleStatus, UpdateResult
from rolefleet.common.sharding import loss_scale, reduce_gradients, shard, sharding_wanted
from rolefleet.common.steps import StepLedger, TrainerState
from rolefleet.common.training import apply_gradients, make_optimizer, run_epochs
from rolefleet.common.workers import (
    group_micro_batches,
    map_micro_batches,
    my_share,
    spmd,
    sum_over_ranks,
    work_group,
)
from rolefleet.critic.model import ValueModel

ROLE = "critic"


class CriticCore:
    def __init__(self, cfg: CriticSection, seed: int = 0, max_staleness: int = 0):
        self.cfg = cfg
        self.max_staleness = max_staleness  # versions an Update's values may lag (pipeline.max_staleness)
        self.device = pick_device()
        torch.manual_seed(seed)
        self.packed = cfg.sequence_packing  # micro-batches as one row each (see SequenceBatch.packed_inputs)
        self.model = ValueModel(cfg.model_name_or_path).to(self.device)
        self.model.eval()
        self.limits = BatchLimits.of(ROLE, cfg, self.model.max_positions)
        self.dtype = compute_dtype(self.device, cfg.compute_dtype)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model.backbone)
        # Several workers: FSDP shards (cfg.sharding) or replicas; every pass in lockstep if sharded.
        self.sharded = sharding_wanted(cfg.sharding)
        if self.sharded:
            shard(self.model, decoder_layers(self.model.backbone), self.device, self.dtype,
                  full_precision=(self.model.head,))
        if cfg.compile_layers:
            compile_decoder_layers(self.model.backbone, hooks_outside=self.sharded)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg)  # over the shards, if sharded
        self.value_loss = VALUE_LOSSES.get("clipped_mse")
        self.generator = torch.Generator().manual_seed(seed)
        self.group = None  # a WorkerGroup when the role runs over several worker processes (serve sets it)
        # Where SaveCheckpoint and LoadCheckpoint may read and write (serve sets the run's checkpoint.dir);
        # None: anywhere (a core used in-process).
        self.checkpoint_root = None
        self.updates_run = 0  # by this process: what `critic.profile_updates` counts
        self.new_graphs = NewGraphs(ROLE)
        self.state = TrainerState(ROLE, versioned="value-model")  # Update's fence: the version of its old values  # model lock, step ledger, model version
        self._lock = self.state.lock

    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """float32 [N], micro-batch by micro-batch."""
        return self.versioned_values(batch)[0]

    def versioned_values(self, batch: SequenceBatch) -> tuple[torch.Tensor, int]:
        """The values and the version that computed them (read under the same lock)."""
        batch.check_limits(self.limits, vocab_size=self.model.vocab_size)
        with self._lock:
            return spmd(self, "_compute_values", batch), self.state.version

    def _compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """SPMD (`workers.spmd`): each rank its share of the micro-batches, gathered in token order."""
        with torch.no_grad(), autocast(self.device, self.dtype):
            (values,) = map_micro_batches(batch, self.cfg.max_tokens_per_micro_batch,
                                          lambda mb: (self.model(mb, self.device, self.packed),), self.packed,
                                          self.sharded)
        return values

    def update(self, step: int, batch: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor,
               values_version: int | None = None) -> UpdateResult:
        """Value-loss epochs over mini-batches. A repeat of an applied step returns its recorded result.
        `values_version`: the critic version that computed `old_values` (None: no fence)."""
        batch.check_limits(self.limits, vocab_size=self.model.vocab_size)
        batch.check_per_token(returns, "returns", "target")
        batch.check_per_token(old_values, "old_values", "target")

        def train() -> dict[str, float]:
            stats = spmd(self, "_train", batch, returns, old_values)
            metrics.COMPILED_GRAPHS.labels(ROLE).inc(stats["compiled_graphs"])
            return stats

        return self.state.update(step, values_version, train, max_lag=self.max_staleness)

    def _train(self, batch: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """SPMD: every rank the same mini-batches (same generator), its share of their micro-batches."""
        def train_step(mb: SequenceBatch, tokens: torch.Tensor) -> dict[str, float]:
            return self._step(mb, returns[tokens], old_values[tokens])

        self.updates_run += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.model.train()
        try:
            with profiled(ROLE, self.updates_run, self.cfg.profile_updates, self.cfg.profile_dir, rank):
                stats = run_epochs(batch, self.cfg.ppo_epochs, self.cfg.num_mini_batches, self.generator, train_step)
        finally:
            self.model.eval()
        stats["compiled_graphs"] = self.new_graphs.take_over_ranks()
        return stats

    @property
    def model_version(self) -> int:
        return self.state.version

    @property
    def ledger(self) -> StepLedger:
        return self.state.ledger

    def _step(self, mb: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step over a mini-batch (packed [n] targets), micro-batch by micro-batch; the
        value loss is a token mean, so each micro-batch weighs by its share of the tokens."""
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
        scale = loss_scale(self.sharded)
        # Several workers: each takes every world-th micro-batch (a throw-away pass, share 0, where
        # sharding needs every rank to run as many).
        for rows, real in my_share(group_micro_batches(mb, self.cfg.max_tokens_per_micro_batch, self.packed),
                                   self.sharded):
            sub, tokens = mb.select(rows), mb.token_index(rows)
            with autocast(self.device, self.dtype):
                values = self.model(sub, self.device, self.packed)
            loss, micro = self.value_loss(values, old_values[tokens].to(self.device),
                                          returns[tokens].to(self.device), torch.ones_like(values, dtype=torch.bool),
                                          self.cfg.value_clip)
            share = len(tokens) / mb.num_response_tokens if real else 0.0
            (loss * (share * scale)).backward()
            stats["vf_loss"] += loss.item() * share
            stats["vf_clipfrac"] += micro["vf_clipfrac"].item() * share
        reduce_gradients(self.model, self.sharded)
        stats = sum_over_ranks(stats)
        stats["vf_lr"] = self.optimizer.param_groups[0]["lr"]
        stats["vf_grad_norm"] = apply_gradients(self.model, self.optimizer, self.cfg.max_grad_norm, stats["vf_loss"],
                                                self.scheduler)
        return stats

    # --- checkpoints (common/checkpoint.py) ------------------------------------------------------

    def save_checkpoint(self, step: int, path: str) -> CheckpointInfo:
        with self._lock:
            return checkpoint.save_role(self, step, path, self._ranks(),
                                        lambda work: checkpoint.save_hf_files(work, self.model.backbone.config))

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        with self._lock:
            return checkpoint.load_role(self, path, self._ranks())

    def _ranks(self) -> list[int]:
        return list(range(self.group.size if self.group else 1))

    def _save_state(self, work: str) -> None:
        """SPMD: each rank its shards; rank 0 the scheduler and RNG states."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        checkpoint.save_trainer(Path(work), self.model, self.optimizer, self.scheduler, self.generator,
                                work_group(), rank == 0)

    def _load_state(self, path: str) -> None:
        checkpoint.load_trainer(Path(path), self.model, self.optimizer, self.scheduler, self.generator,
                                work_group())

    def status(self, include_digest: bool = False) -> RoleStatus:
        """A snapshot read without the model lock; the weight digest waits for it, only when asked."""
        return RoleStatus(ROLE, self.model_version, self.ledger.last_step,
                          self.digest() if include_digest else "", broken=self.ledger.broken or "",
                          workers=self.group.size if self.group else 1)

    def digest(self) -> str:
        with self._lock:
            return spmd(self, "_digest")

    def _digest(self) -> str:
        """SPMD: sharded weights are gathered on every rank."""
        return weights_digest(self.model)

    def close(self) -> None:
        with self._lock:
            del self.model, self.optimizer
        release_memory()

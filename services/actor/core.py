"""ActorCore: the actor role without gRPC. Tests drive it in-process; the servicer wraps it."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from rolefleet.actor import vllm_sync, weight_sync
from rolefleet.actor.placement import ActorPlacement, engine_size
from rolefleet.actor.rollout import RolloutEngine, choose_backend, derived_seed, vllm_installed
from rolefleet.actor.rollout_hf import HFRolloutEngine
from rolefleet.actor.trainer import PolicyTrainer
from rolefleet.actor.types import (
    SAMPLES_PER_GROUP_LIMIT,
    ActorUpdateResult,
    LogProbs,
    PolicyTargets,
    Sample,
    SamplingParams,
    with_ids,
)
from rolefleet.common import checkpoint, metrics
from rolefleet.common.batch import BatchLimits, SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.common.modeling import (
    compute_dtype,
    load_causal_lm,
    load_tokenizer,
    pick_device,
    release_memory,
    require_temperature,
    weights_digest,
)
from rolefleet.common.profiling import NewGraphs, profiled
from rolefleet.common.role_types import CheckpointInfo, RoleStatus
from rolefleet.common.sharding import full_named_parameters
from rolefleet.common.steps import PartialUpdate, StepLedger, TrainerState
from rolefleet.common.stop_tokens import checkpoint_stop_ids, warn_if_turn_runs_on
from rolefleet.common.workers import (
    all_gather,
    free_port,
    new_subgroups,
    rank_slice,
    set_work_group,
    spmd,
    work_group,
)

log = logging.getLogger(__name__)
ROLE = "actor"
MAX_GROUPS = 2**63 // SAMPLES_PER_GROUP_LIMIT  # group ids below it give int64 sample ids


class ActorCore:
    def __init__(self, cfg: ActorSection, seed: int = 0, max_staleness: int = 0, rollout_ranks: tuple[int, ...] = ()):
        """`rollout_ranks`: the worker ranks that only generate (`placement.rollout_ranks`); empty:
        every rank trains and generates."""
        self.cfg = cfg
        self.max_staleness = max_staleness  # updates an Update's oldest sample may lag (pipeline.max_staleness)
        self.device = pick_device()
        torch.manual_seed(seed)
        world = dist.get_world_size() if dist.is_initialized() else 1
        placement = ActorPlacement(world, tuple(rollout_ranks))
        self.backend = choose_backend(cfg.rollout.backend, self.device.type == "cuda", vllm_installed(), world,
                                      placement.split)
        self.placement = replace(placement, engine_size=engine_size(cfg, self.backend, placement))
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.trains = self.rank in self.placement.train_ranks
        self.sync_group = self._join_part()
        self.tokenizer = load_tokenizer(cfg.model_name_or_path)
        self.model = load_causal_lm(cfg.model_name_or_path, self.device)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        # Where the checkpoint ends a response (its tokenizer's eos and generation config's
        # eos_token_id list), before the hf engine clears its copy's generation defaults.
        self.stop_ids = checkpoint_stop_ids(self.tokenizer, self.model.generation_config)
        if beyond := [i for i in self.stop_ids if i >= self.vocab_size]:  # a config of another vocabulary
            log.warning("%s: stop ids %s are not below the vocabulary size %d and are ignored",
                        cfg.model_name_or_path, beyond, self.vocab_size)
            self.stop_ids = tuple(i for i in self.stop_ids if i < self.vocab_size)
        if self.rank == 0:
            warn_if_turn_runs_on(self.tokenizer, self.stop_ids, cfg.model_name_or_path)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.model_config = self.model.config  # what a checkpoint's hf/ needs, on every rank
        self.limits = BatchLimits.of(ROLE, cfg, self.max_positions)
        # What a weight sync carries, in order (the full shapes: taken before the trainer shards).
        self.weight_shapes = [(name, tuple(p.shape)) for name, p in self.model.named_parameters()]
        self.engine: RolloutEngine | None = None
        if self.rank in self.placement.engine_ranks:
            if self.remote_engines and not self.trains:
                self.model = None  # the engine loads its own copy: leave it the GPU
                release_memory()
            self.engine = self._make_engine(seed)
        self._vllm_sender: vllm_sync.Sender | None = None  # split vllm: the first trainer's end of the link
        self._vllm_linked = False  # ... which the sync ranks open at the first sync
        self.group = None  # a WorkerGroup when the role runs over several worker processes (serve sets it)
        # Where SaveCheckpoint and LoadCheckpoint may read and write (serve sets the run's checkpoint.dir);
        # None: anywhere (a core used in-process).
        self.checkpoint_root = None
        self.updates_run = 0  # by this process: what `actor.profile_updates` counts
        self.new_graphs = NewGraphs(ROLE)
        self.generates_run = 0  # ... and its generations, `actor.rollout.profile_generates`
        self.ref_model, self.trainer = None, None
        if self.trains:
            self.ref_model = self._load_reference()
            self.trainer = PolicyTrainer(self.model, self.ref_model, self.device, cfg, seed)
        else:  # a rollout worker: its engine has its own copy
            self.model = None
            release_memory()
        # The trainer's lock, step ledger and policy version. Colocated, generation takes the same
        # lock (one model, used by one at a time); split, the rollout workers have their own, and
        # only a weight sync takes both.
        self.state = TrainerState(ROLE)
        self._lock = self.state.lock
        self._one_pass_logprobs: tuple[int, LogProbs | None] = (0, None)  # (step, its update's logprobs)
        self._rollout_lock = threading.Lock() if self.placement.split else self._lock
        self.rollout_version = 0  # the policy version whose weights the engines hold
        metrics.MODEL_VERSION.labels(ROLE).set(0)

    def _join_part(self):
        """Split placement: the trainers and the rollout workers each do their collectives in their
        own process group; returns the group a weight sync broadcasts in (None: colocated)."""
        if not self.placement.split:
            set_work_group(None)
            return None
        p = self.placement
        trainers, engines, sync = new_subgroups([p.train_ranks, p.engine_ranks, p.sync_ranks])
        # A rollout rank that only lends its GPU to another's engine has no work of its own: None
        # (it never runs a collective outside the weight sync).
        set_work_group(trainers if self.trains else engines)
        if self.rank == 0:
            log.info("actor placement: %s", p.describe())
        return sync

    def _load_reference(self):
        cfg = self.cfg
        if cfg.ref_model_name_or_path == cfg.model_name_or_path:
            ref_model = copy.deepcopy(self.model)  # same weights: skip a second read from disk
        else:
            ref_model = load_causal_lm(cfg.ref_model_name_or_path, self.device)
        ref_model.requires_grad_(False).eval()
        if cfg.ref_offload:
            ref_model.to("cpu")  # the trainer brings it to the GPU for each ComputeLogProbs
        return ref_model

    @property
    def remote_engines(self) -> bool:
        """vLLM engines in processes of their own, fed over NCCL by the first trainer (split)."""
        return self.backend == "vllm" and self.placement.split

    def _make_engine(self, seed: int) -> RolloutEngine:
        log.info("rollout backend: %s", self.backend)
        if self.backend == "vllm":
            try:
                from rolefleet.actor.rollout_vllm import VllmRolloutEngine

                policy = self.model if self.trains else None  # a rollout worker keeps no trainer copy
                gpus = None
                if self.remote_engines:
                    visible = _visible_gpus()
                    gpus = [visible[r] for r in self.placement.engine_members(self.rank)]
                return VllmRolloutEngine(policy, self.tokenizer, self.cfg, self.cfg.model_name_or_path, self.stop_ids,
                                         seed, gpus)
            except Exception as exc:  # an installed vLLM that cannot start here (its torch pin, say)
                if self.cfg.rollout.backend == "vllm" or self.remote_engines:  # the trainers expect vLLM's
                    raise
                log.warning("actor.rollout.backend=auto: vLLM is installed but did not start (%s); using hf", exc)
        return HFRolloutEngine(self.model, self.tokenizer, self.device, self.cfg,
                               compute_dtype(self.device, self.cfg.compute_dtype), self.stop_ids)

    # --- rollouts ---------------------------------------------------------------------------------

    def tokenize_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        if not prompts:
            raise InvalidArgument("prompts", "no prompts given")
        # Sizes first: tokenizing a 10 MB prompt takes half a minute and gigabytes, only to be refused.
        for i, prompt in enumerate(prompts):
            size = len(prompt.encode("utf-8", errors="surrogatepass"))
            if size > self.cfg.max_prompt_bytes:
                raise LimitExceeded(f"prompts[{i}]", f"{size} bytes exceed actor.max_prompt_bytes="
                                    f"{self.cfg.max_prompt_bytes}")
        ids = []
        for i, prompt in enumerate(prompts):
            tokens = self.tokenizer(prompt)["input_ids"]
            if not tokens:
                raise InvalidArgument(f"prompts[{i}]", "tokenizes to no tokens")
            ids.append(torch.tensor(tokens, dtype=torch.int64))
        return ids

    def generate(self, prompts: list[str], sampling: SamplingParams, first_group_id: int = 0) -> list[Sample]:
        return [sample for chunk in self.generate_chunks(prompts, sampling, first_group_id) for sample in chunk]

    def generate_chunks(self, prompts: list[str], sampling: SamplingParams,
                        first_group_id: int = 0) -> Iterator[list[Sample]]:
        """Samples as each forward batch finishes, stamped with group ids from `first_group_id`.
        Input is validated before the first chunk; the model stays locked until the iterator is
        exhausted or closed."""
        prompt_ids = self._validate_generate(prompts, sampling)
        if first_group_id < 0:
            raise InvalidArgument("first_group_id", f"must be >= 0, got {first_group_id}")
        if first_group_id + len(prompts) > MAX_GROUPS:  # else a sample id overflows int64 on the wire
            raise InvalidArgument("first_group_id", f"{first_group_id} + {len(prompts)} prompts exceed {MAX_GROUPS} "
                                  f"groups: sample ids (group_id * {SAMPLES_PER_GROUP_LIMIT} + sample_index) are int64")
        return (with_ids(chunk, first_group_id) for chunk in self._locked_chunks(prompt_ids, sampling))

    def _locked_chunks(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams) -> Iterator[list[Sample]]:
        """The engine's chunks, under the rollout lock until it has made the request's last sample:
        the caller's encoding and sending of that chunk (a message per sample; the GPU sat idle for
        50-60 ms of it at 256 samples, profiled) then holds up neither a weight sync nor the next
        request."""
        expected, made = len(prompt_ids) * sampling.n, 0
        self._rollout_lock.acquire()
        held, start = True, time.perf_counter()
        try:
            version = self.rollout_version
            if self.group is None or self.placement.engine_ranks == [self.rank]:
                # This process drives the only engine (alone, or the split actor's only rollout
                # worker): each engine call's samples stream as they finish.
                chunks = self._engine_chunks(prompt_ids, sampling, version)
            else:  # each engine generates its share of the prompts; one chunk when all are done
                chunks = iter([spmd(self, "_generate_share", prompt_ids, sampling, version,
                                    ranks=self.placement.engine_ranks)])
            for chunk in chunks:
                metrics.TOKENS_GENERATED.labels(ROLE).inc(sum(len(s.response_ids) for s in chunk))
                made += len(chunk)
                if made >= expected:  # the engine is done with this request
                    held = False
                    self._rollout_lock.release()
                    metrics.ROLLOUT_SECONDS.labels(ROLE).observe(time.perf_counter() - start)
                yield chunk
        finally:
            if held:
                self._rollout_lock.release()

    def _generate_share(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams, version: int) -> list[Sample]:
        """SPMD: this rank's contiguous share of the prompts (all n samples of each), gathered in
        prompt order. A seeded request draws per rank (a seed derived from the share's first prompt)."""
        mine = rank_slice(len(prompt_ids)).tolist()
        samples = []
        if mine:
            offset = mine[0]
            seeded = replace(sampling, seed=derived_seed(sampling.seed, offset))
            for chunk in self._engine_chunks([prompt_ids[i] for i in mine], seeded, version):
                samples += [replace(s, prompt_index=s.prompt_index + offset) for s in chunk]
        return [s for part in all_gather(samples) for s in part]

    def _engine_chunks(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                       version: int) -> Iterator[list[Sample]]:
        """This process's engine's samples, each engine call as it finishes."""
        self.generates_run += 1
        with profiled(ROLE, self.generates_run, self.cfg.rollout.profile_generates, self.cfg.profile_dir,
                      self.rank, what="generate"):
            yield from self.engine.generate(prompt_ids, sampling, version)

    def _validate_generate(self, prompts: list[str], sampling: SamplingParams) -> list[torch.Tensor]:
        sampling.validate()
        for i, token in enumerate(sampling.stop_token_ids):
            if token >= self.vocab_size:
                raise InvalidArgument(f"sampling.stop_token_ids[{i}]", f"{token} is not below the model's vocabulary "
                                      f"size {self.vocab_size}")
        if len(prompts) * sampling.n > self.cfg.max_sequences_per_request:
            raise LimitExceeded("sampling.n", f"{len(prompts)} prompts x n={sampling.n} exceed "
                                f"actor.max_sequences_per_request={self.cfg.max_sequences_per_request}")
        limit = self.max_positions
        if limit is not None and 1 + sampling.max_new_tokens > limit:  # before tokenizing anything
            raise InvalidArgument("sampling.max_new_tokens", f"{sampling.max_new_tokens} new tokens exceed "
                                  f"the model's {limit} positions")
        prompt_ids = self.tokenize_prompts(prompts)
        longest = max(len(p) for p in prompt_ids)
        if limit is not None and longest + sampling.max_new_tokens > limit:
            raise InvalidArgument("sampling.max_new_tokens", f"{sampling.max_new_tokens} new tokens after a "
                                  f"{longest}-token prompt exceed the model's {limit} positions")
        return prompt_ids

    # --- training ---------------------------------------------------------------------------------

    def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                         reference_only: bool = False) -> LogProbs:
        """The policy's logprobs and entropy, and the reference's logprobs if asked for, of the
        batch's response tokens; `reference_only`: the reference's alone (for a one-pass update)."""
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        temperature = require_temperature(temperature)
        if reference_only and not include_reference:
            raise InvalidArgument("include_reference", "false with reference_only: nothing asked for")
        with self._lock:
            return spmd(self, "_compute_logprobs", batch, temperature, include_reference, not reference_only,
                        self.policy_version, ranks=self.placement.train_ranks)

    def _compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                          include_policy: bool, version: int) -> LogProbs:
        """SPMD (`workers.spmd`): each rank its share of the micro-batches, gathered in token order."""
        return self.trainer.compute_logprobs(batch, temperature, include_reference, version, include_policy)

    def update(self, step: int, policy_version: int, batch: SequenceBatch, targets: PolicyTargets,
               temperature: float) -> ActorUpdateResult:
        """One policy update. A repeat of an applied step returns its recorded result unchanged."""
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        self._check_targets(batch, targets)
        temperature = require_temperature(temperature)

        result = self.state.update(step, policy_version,
                                   lambda: self._train_and_publish(step, batch, targets, temperature),
                                   max_lag=self.max_staleness)
        kept_step, logprobs = self._one_pass_logprobs
        return ActorUpdateResult(**vars(result), logprobs=logprobs if kept_step == step else None)

    def _train_and_publish(self, step: int, batch: SequenceBatch, targets: PolicyTargets,
                           temperature: float) -> dict[str, float]:
        stats, logprobs = spmd(self, "_train", batch, targets, temperature, ranks=self.placement.train_ranks)
        if logprobs is not None:  # a one-pass update's: kept for its replay, the newest step's only
            self._one_pass_logprobs = (step, replace(logprobs, policy_version=self.state.version))
        stats["weight_sync_s"] = self._publish_weights(self.state.version + 1)
        metrics.COMPILED_GRAPHS.labels(ROLE).inc(stats["compiled_graphs"])
        return stats

    def _train(self, batch: SequenceBatch, targets: PolicyTargets,
               temperature: float) -> tuple[dict[str, float], LogProbs | None]:
        """SPMD over the trainers: every rank steps its shard or replica with the group's gradients."""
        self.updates_run += 1
        with profiled(ROLE, self.updates_run, self.cfg.profile_updates, self.cfg.profile_dir, self.rank):
            if self.engine is not None:
                self.engine.sleep()  # colocated: the trainer needs the memory more than the engine's caches
            stats, logprobs = self.trainer.update(batch, targets, temperature)
        stats["compiled_graphs"] = self.new_graphs.take_over_ranks()
        return stats, logprobs

    @property
    def policy_version(self) -> int:
        return self.state.version

    @property
    def ledger(self) -> StepLedger:
        return self.state.ledger

    def _publish_weights(self, version: int) -> float:
        """Move the new weights into every rollout engine; the next Generate samples from them and
        stamps `version`. Split placement waits for a generation in flight to finish first. Inside
        the ledger's `applying`: a failure here leaves the engines neither old nor new."""
        start = time.perf_counter()
        with self._rollout_lock if self.placement.split else contextlib.nullcontext():  # colocated: held
            spmd(self, "_load_weights", version)
        seconds = time.perf_counter() - start
        metrics.WEIGHT_SYNC_SECONDS.labels(ROLE).observe(seconds)
        return seconds

    def _load_weights(self, version: int) -> None:
        """SPMD, every rank. Colocated: each rank loads its trainer's weights (gathered, if sharded)
        into its engine. Split: the first trainer broadcasts them in buckets to the rollout workers
        (vllm: into the engines' own processes)."""
        try:
            if self.remote_engines and not self._vllm_linked and self.rank in self.placement.sync_ranks:
                self._open_vllm_link()
            if not self.placement.split:
                self.engine.load_weights(full_named_parameters(self.model))
                self.engine.reset_cache()
                self.engine.wake()
            elif self.trains:
                self._send_weights()
            elif self.remote_engines:
                if self.engine is not None:  # else this rank's GPU serves another rank's engine
                    self.engine.receive_weights(vllm_sync.update_info(self.weight_shapes, self._wire_dtype(),
                                                                      self._bucket_bytes()))
                    self.engine.reset_cache()
            else:
                for part in weight_sync.receive(self.weight_shapes, self.placement.train_ranks[0], self.sync_group,
                                                self._wire_dtype(), self.device, self._bucket_bytes()):
                    self.engine.load_weights(part)
                self.engine.reset_cache()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies are asynchronous: time them whole
        except Exception as exc:  # the trainer's weights moved: a retry must not apply the step again
            raise PartialUpdate(f"moving the new weights into the rollout engine failed ({exc})") from exc
        self.rollout_version = version

    def _send_weights(self) -> None:
        named = full_named_parameters(self.model)  # sharded: a gather every trainer takes part in
        sender = self.placement.train_ranks[0]
        if self.rank != sender:
            for _ in named:
                pass
            return
        if self.remote_engines:
            self._vllm_sender.send(named, self.weight_shapes, self._wire_dtype(), self._bucket_bytes())
        else:
            weight_sync.send(named, self.weight_shapes, sender, self.sync_group, self._wire_dtype(), self.device,
                             self._bucket_bytes())

    def _open_vllm_link(self) -> None:
        """First sync to vLLM engines, on the sync ranks: the sending trainer picks the port of the
        communicator and tells the rollout ranks; it and every engine's workers then join it, each
        from its own process at the same time (`vllm_sync.py`)."""
        p = self.placement
        sender = p.train_ranks[0]
        port = [free_port() if self.rank == sender else None]
        dist.broadcast_object_list(port, src=sender, group=self.sync_group)
        world = 1 + len(p.rollout_ranks)  # the trainer and one engine worker per rollout GPU
        if self.rank == sender:
            self._vllm_sender = vllm_sync.Sender(port[0], world)
        elif self.engine is not None:
            self.engine.join_weight_transfer(vllm_sync.init_info(port[0], 1 + p.rollout_ranks.index(self.rank), world))
        self._vllm_linked = True

    def _wire_dtype(self) -> torch.dtype:
        """The engines' dtype (what `load_weights` would cast to anyway): half the bytes of fp32."""
        return compute_dtype(self.device, self.cfg.compute_dtype) or torch.float32

    def _bucket_bytes(self) -> int:
        return self.cfg.rollout.sync_bucket_mb << 20

    def _check_targets(self, batch: SequenceBatch, targets: PolicyTargets) -> None:
        batch.check_per_token(targets.advantages, "advantages", "target")
        if targets.old_logprobs is not None:
            batch.check_per_token(targets.old_logprobs, "old_logprobs", "logprob")
        elif (problem := self.cfg.one_pass_problem()) is not None:
            raise InvalidArgument("old_logprobs", f"required: {problem}")
        if self.cfg.kl_loss_coef > 0 and targets.ref_logprobs is None:
            raise InvalidArgument("ref_logprobs", "required: actor.kl_loss_coef > 0 adds a KL loss term")
        if self.cfg.is_correction != "none" and targets.rollout_logprobs is None:
            raise InvalidArgument("rollout_logprobs", f"required by actor.is_correction={self.cfg.is_correction}")
        for name in ("ref_logprobs", "rollout_logprobs"):
            if getattr(targets, name) is not None:
                batch.check_per_token(getattr(targets, name), name, "logprob")

    # --- checkpoints (common/checkpoint.py) ------------------------------------------------------

    def save_checkpoint(self, step: int, path: str) -> CheckpointInfo:
        """The trainer's state as of `step` (its last applied one) into `path`; a repeat answers
        from disk."""
        with self._lock:
            return checkpoint.save_role(self, step, path, self.placement.train_ranks,
                                        lambda work: checkpoint.save_hf_files(work, self.model_config, self.tokenizer))

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        """The trainer's state from `path`; the rollout engines take the loaded weights and version."""
        with self._lock:
            info = checkpoint.load_role(self, path, self.placement.train_ranks)
            with self.ledger.applying(info.step):  # engines left half loaded: refuse updates until restarted
                self._publish_weights(info.model_version)
            return info

    def _save_state(self, work: str) -> None:
        """SPMD over the trainers: each its shards; the first one the scheduler and RNG states."""
        checkpoint.save_trainer(Path(work), self.model, self.trainer.optimizer, self.trainer.scheduler,
                                self.trainer.generator, work_group(), self.rank == self.placement.train_ranks[0])

    def _load_state(self, path: str) -> None:
        """SPMD over the trainers: the inverse of `_save_state`, resharded to this group."""
        checkpoint.load_trainer(Path(path), self.model, self.trainer.optimizer, self.trainer.scheduler,
                                self.trainer.generator, work_group())

    # --- status / lifecycle -----------------------------------------------------------------------

    def status(self, include_digest: bool = False) -> RoleStatus:
        """A snapshot read without the model lock (a rollout or update may be in flight); hashing
        the weights waits for the lock and is done only when asked."""
        return RoleStatus(ROLE, self.policy_version, self.ledger.last_step,
                          self.digest() if include_digest else "", broken=self.ledger.broken or "",
                          workers=self.group.size if self.group else 1)

    def digest(self) -> str:
        with self._lock:
            return spmd(self, "_digest", ranks=self.placement.train_ranks)

    def _digest(self) -> str:
        """SPMD over the trainers: sharded weights are gathered on every one."""
        return weights_digest(self.model)

    def close(self) -> None:
        with self._lock:
            if self.engine is not None and hasattr(self.engine, "close"):
                self.engine.close()
            self.engine = self.trainer = self.model = self.ref_model = None
        release_memory()


def _visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (rank i of a group drives entry i)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]

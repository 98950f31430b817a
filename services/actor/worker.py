"""The actor's worker: one per rank of its group (DESIGN "Process model").

A rank trains (a `PolicyTrainer` over the policy and the reference), generates (a rollout engine),
or both (colocated); which, and how the new weights reach the engines (`transport.py`), is decided
here once, from the placement (`placement.py`). The controller (`core.py`) reaches the worker only
through its collective methods, each on its part of the group: "trainers", "engines" or "all".
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from rolefleet.actor import transport
from rolefleet.actor.engines import make_engine
from rolefleet.actor.placement import ActorPlacement, engine_size, rollout_ranks
from rolefleet.actor.rollout import RolloutEngine, choose_backend, derived_seed, vllm_installed
from rolefleet.actor.trainer import PolicyTrainer
from rolefleet.actor.types import LogProbs, PolicyTargets, Sample, SamplingParams
from rolefleet.common import progress
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ActorSection, RoleFleetConfig
from rolefleet.common.modeling import compute_dtype, load_causal_lm, load_tokenizer, release_memory
from rolefleet.common.stop_tokens import checkpoint_stop_ids, warn_if_turn_runs_on
from rolefleet.trainer.loading import build_on_meta, is_pending
from rolefleet.trainer.lora import merged_shapes
from rolefleet.trainer.profiling import profiled
from rolefleet.trainer.ranks import Ranks, global_rank, global_world, new_subgroups
from rolefleet.trainer.sharding import sharding_wanted
from rolefleet.trainer.steps import PartialUpdate
from rolefleet.trainer.worker import TrainingWorker
from rolefleet.trainer.workers import collective

log = logging.getLogger(__name__)
ROLE = "actor"


class ActorWorker(TrainingWorker):
    role = ROLE

    def __init__(self, cfg: ActorSection, seed: int = 0, rollout_ranks: tuple[int, ...] = ()):
        """`rollout_ranks`: the ranks that only generate (`placement.rollout_ranks`); empty: every
        rank trains and generates."""
        super().__init__(cfg, seed)
        world, self.rank = global_world(), global_rank()
        placement = ActorPlacement(world, tuple(rollout_ranks))
        self.backend = choose_backend(cfg.rollout.backend, self.device.type == "cuda", vllm_installed(), world,
                                      placement.split)
        if problem := cfg.lora_engine_problem(self.backend, placement.split):  # backend auto chose vLLM
            raise ValueError(problem)
        self.placement = p = replace(placement, engine_size=engine_size(cfg, self.backend, placement))
        self.parts = {"all": list(range(world)), "trainers": p.train_ranks, "engines": p.engine_ranks}
        self.ranks, sync_group = self._join_parts()
        self.tokenizer = load_tokenizer(cfg.model_name_or_path, bool(cfg.trust_remote_code))
        model = self._load_policy(cfg.model_name_or_path)
        self._read_model_facts(model)
        self.model = model if self.rank in p.train_ranks else None  # a rollout rank's engine has its own copy
        choice = transport.choose(p, self.backend)
        self.engine: RolloutEngine | None = None
        if self.rank in p.engine_ranks:
            progress.report(f"building the {self.backend} rollout engine")
            own_processes = choice is transport.VllmLink
            if own_processes and self.model is None:
                model = None  # the engine loads its own copy: leave it the GPU
                release_memory()
            self.engine = make_engine(self.backend, cfg, model, self.tokenizer, self.device, self.stop_ids, seed,
                                      p.engine_members(self.rank) if own_processes else None)
        del model
        self.ref_model, self.trainer = None, None
        if self.model is not None:
            progress.report("building the trainer")
            self.ref_model = self._load_reference()
            self.trainer = PolicyTrainer(self.model, self.ref_model, self.device, cfg, seed, self.ranks)
        release_memory()
        # What a sync carries, in order: every weight, or with adapters the adapted layers' (merged).
        shapes = merged_shapes(self.model_config, cfg.lora) if cfg.lora.enabled else self.weight_shapes
        self.transport = choice(self.trainer and self.trainer.engine_weights, self.engine, transport.Route(
            p, self.rank, shapes, self.wire_dtype, self.device, cfg.rollout.sync_bucket_mb << 20, sync_group))
        self.rollout_version = 0  # the policy version whose weights the engines hold
        self.generates_run = 0  # by this process: what `actor.rollout.profile_generates` counts

    @classmethod
    def from_config(cls, cfg: RoleFleetConfig) -> ActorWorker:
        return cls(cfg.actor, seed=cfg.run.seed, rollout_ranks=rollout_ranks(cfg))

    def _join_parts(self) -> tuple[Ranks, object]:
        """Split placement: the trainers and the rollout workers each do their collectives in their
        own process group; returns this rank's part and the group a weight sync broadcasts in."""
        p = self.placement
        if not p.split:
            return Ranks.of(None), None
        trainers, engines, sync = new_subgroups([p.train_ranks, p.engine_ranks, p.sync_ranks])
        if self.rank == 0:
            log.info("actor placement: %s", p.describe())
        # A rollout rank that only lends its GPU to another's engine has no part of its own (it never
        # runs a collective outside the weight sync).
        part = trainers if self.rank in p.train_ranks else engines
        return (Ranks.of(part) if part is not None else Ranks.alone()), sync

    def _read_model_facts(self, model) -> None:
        """What the controller validates requests against and a checkpoint's hf/ needs, on every rank."""
        cfg = self.cfg
        self.vocab_size = model.get_input_embeddings().num_embeddings
        # Where the checkpoint ends a response (its tokenizer's eos and generation config's
        # eos_token_id list), before the hf engine clears its copy's generation defaults.
        stop_ids = checkpoint_stop_ids(self.tokenizer, model.generation_config)
        if beyond := [i for i in stop_ids if i >= self.vocab_size]:  # a config of another vocabulary
            log.warning("%s: stop ids %s are not below the vocabulary size %d and are ignored",
                        cfg.model_name_or_path, beyond, self.vocab_size)
            stop_ids = tuple(i for i in stop_ids if i < self.vocab_size)
        self.stop_ids = stop_ids
        if self.rank == 0:
            warn_if_turn_runs_on(self.tokenizer, self.stop_ids, cfg.model_name_or_path)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.model_config = model.config
        # What a weight sync carries, in order (the full shapes: taken before the trainer shards).
        self.weight_shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]

    def _load_policy(self, path: str):
        """A training rank that shards gets a skeleton filled shard by shard when the trainer shards
        it (`trainer.loading`): no rank ever holds the whole model. Adapters are injected into
        whole weights, so a LoRA policy loads whole."""
        cfg = self.cfg
        if self.rank in self.placement.train_ranks and sharding_wanted(cfg, self.ranks) and not cfg.lora.enabled:
            if (skeleton := build_on_meta(AutoModelForCausalLM, path, bool(cfg.trust_remote_code))) is not None:
                return skeleton
        return load_causal_lm(path, self.device, trust_remote_code=bool(cfg.trust_remote_code))

    def _load_reference(self):
        """The reference model; None with adapters on the same model (the policy with them off is
        it), or for the sft loss (none at all)."""
        cfg = self.cfg
        if not cfg.holds_reference:  # the policy with its adapters off, or none at all (the sft loss)
            return None
        if cfg.ref_model_name_or_path != cfg.model_name_or_path or is_pending(self.model):
            ref_model = self._load_policy(cfg.ref_model_name_or_path)  # a skeleton of its own to fill
        else:
            ref_model = copy.deepcopy(self.model)  # same weights: skip a second read from disk
        ref_model.requires_grad_(False).eval()
        return ref_model  # with `ref_offload`, the trainer moves it to host memory

    @property
    def wire_dtype(self) -> torch.dtype:
        """The engines' dtype (what `load_weights` would cast to anyway): half the bytes of fp32."""
        return compute_dtype(self.device, self.cfg.compute_dtype) or torch.float32

    # --- rollouts ---------------------------------------------------------------------------------

    def engine_chunks(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                      version: int) -> Iterator[list[Sample]]:
        """This process's engine's samples, each engine call as it finishes."""
        self.generates_run += 1
        with profiled(ROLE, self.generates_run, self.cfg.rollout.profile_generates, self.cfg.profile_dir,
                      self.rank, what="generate"):
            yield from self.engine.generate(prompt_ids, sampling, version)

    @collective("engines")
    def generate_share(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams, version: int) -> list[Sample]:
        """This engine's contiguous share of the prompts (all n samples of each), gathered in prompt
        order. A seeded request draws per engine (a seed derived from the share's first prompt)."""
        mine = self.ranks.slice(len(prompt_ids)).tolist()
        samples = []
        if mine:
            offset = mine[0]
            seeded = replace(sampling, seed=derived_seed(sampling.seed, offset))
            for chunk in self.engine_chunks([prompt_ids[i] for i in mine], seeded, version):
                samples += [replace(s, prompt_index=s.prompt_index + offset) for s in chunk]
        return [s for part in self.ranks.all_gather(samples) for s in part]

    # --- training ---------------------------------------------------------------------------------

    @collective("trainers")
    def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                         include_policy: bool, version: int) -> LogProbs:
        """Each rank its share of the micro-batches, gathered in token order."""
        return self.trainer.compute_logprobs(batch, temperature, include_reference, version, include_policy)

    @collective("trainers")
    def train(self, batch: SequenceBatch, targets: PolicyTargets,
              temperature: float) -> tuple[dict[str, float], LogProbs | None]:
        """Every rank steps its shard or replica with the group's gradients."""
        def update():
            self.transport.before_update()
            stats, logprobs = self.trainer.update(batch, targets, temperature)
            if self.engine is not None:  # a colocated engine: what it built since, what it keeps
                stats.update(self.engine.take_stats())
            return stats, logprobs

        return self.profiled_update(update)

    @collective("all")
    def sync_weights(self, version: int) -> None:
        """Move the trainer's new weights into every engine (`transport.py`); the next Generate
        stamps `version`. A failure leaves the engines neither old nor new: PartialUpdate."""
        try:
            self.transport.sync()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies are asynchronous: time them whole
        except Exception as exc:  # the trainer's weights moved: a retry must not apply the step again
            raise PartialUpdate(f"moving the new weights into the rollout engine failed ({exc})") from exc
        self.rollout_version = version

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self.trainer = self.model = self.ref_model = self.transport = None
        release_memory()

"""ActorCore: the actor role without gRPC. Tests drive it in-process; the servicer wraps it."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from rolefleet.actor.rollout import RolloutEngine, choose_backend, derived_seed, vllm_installed
from rolefleet.actor.rollout_hf import HFRolloutEngine
from rolefleet.actor.trainer import PolicyTrainer
from rolefleet.actor.types import LogProbs, PolicyTargets, Sample, SamplingParams, with_ids
from rolefleet.common import metrics
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
from rolefleet.common.roles import RoleStatus, UpdateResult
from rolefleet.common.sharding import full_named_parameters
from rolefleet.common.steps import PartialUpdate, StepLedger, TrainerState
from rolefleet.common.workers import all_gather, rank_slice, spmd

log = logging.getLogger(__name__)
ROLE = "actor"


class ActorCore:
    def __init__(self, cfg: ActorSection, seed: int = 0, max_staleness: int = 0):
        self.cfg = cfg
        self.max_staleness = max_staleness  # updates an Update's oldest sample may lag (pipeline.max_staleness)
        self.device = pick_device()
        torch.manual_seed(seed)
        self.tokenizer = load_tokenizer(cfg.model_name_or_path)
        self.model = load_causal_lm(cfg.model_name_or_path, self.device)
        if cfg.ref_model_name_or_path == cfg.model_name_or_path:
            self.ref_model = copy.deepcopy(self.model)  # same weights: skip a second read from disk
        else:
            self.ref_model = load_causal_lm(cfg.ref_model_name_or_path, self.device)
        self.ref_model.requires_grad_(False).eval()
        if cfg.ref_offload:
            self.ref_model.to("cpu")  # the trainer brings it to the GPU for each ComputeLogProbs
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.limits = BatchLimits.of(ROLE, cfg, self.max_positions)
        self.engine: RolloutEngine = self._make_engine(seed)
        self.group = None  # a WorkerGroup when the role runs over several worker processes (serve sets it)
        self.trainer = PolicyTrainer(self.model, self.ref_model, self.device, cfg, seed)
        # The model lock (generation and updates never interleave), step ledger and policy version.
        self.state = TrainerState(ROLE)
        self._lock = self.state.lock
        metrics.MODEL_VERSION.labels(ROLE).set(0)

    def _make_engine(self, seed: int) -> RolloutEngine:
        backend = choose_backend(self.cfg.rollout.backend, self.device.type == "cuda", vllm_installed())
        log.info("rollout backend: %s", backend)
        if backend == "vllm":
            try:
                from rolefleet.actor.rollout_vllm import VllmRolloutEngine

                return VllmRolloutEngine(self.model, self.tokenizer, self.cfg, self.cfg.model_name_or_path, seed)
            except Exception as exc:  # an installed vLLM that cannot start here (its torch pin, say)
                if self.cfg.rollout.backend == "vllm":
                    raise
                log.warning("actor.rollout.backend=auto: vLLM is installed but did not start (%s); using hf", exc)
        return HFRolloutEngine(self.model, self.tokenizer, self.device, self.cfg,
                               compute_dtype(self.device, self.cfg.compute_dtype))

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
        return (with_ids(chunk, first_group_id) for chunk in self._locked_chunks(prompt_ids, sampling))

    def _locked_chunks(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams) -> Iterator[list[Sample]]:
        with self._lock, metrics.ROLLOUT_SECONDS.labels(ROLE).time():
            if self.group is None:
                chunks = self.engine.generate(prompt_ids, sampling, self.policy_version)
            else:  # each worker generates its share of the prompts; one chunk when all are done
                chunks = iter([spmd(self, "_generate_share", prompt_ids, sampling, self.policy_version)])
            for chunk in chunks:
                metrics.TOKENS_GENERATED.labels(ROLE).inc(sum(len(s.response_ids) for s in chunk))
                yield chunk

    def _generate_share(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams, version: int) -> list[Sample]:
        """SPMD: this rank's contiguous share of the prompts (all n samples of each), gathered in
        prompt order. A seeded request draws per rank (a seed derived from the share's first prompt)."""
        mine = rank_slice(len(prompt_ids)).tolist()
        samples = []
        if mine:
            offset = mine[0]
            seeded = replace(sampling, seed=derived_seed(sampling.seed, offset))
            for chunk in self.engine.generate([prompt_ids[i] for i in mine], seeded, version):
                samples += [replace(s, prompt_index=s.prompt_index + offset) for s in chunk]
        return [s for part in all_gather(samples) for s in part]

    def _validate_generate(self, prompts: list[str], sampling: SamplingParams) -> list[torch.Tensor]:
        sampling.validate()
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

    def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool) -> LogProbs:
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        temperature = require_temperature(temperature)
        with self._lock:
            return spmd(self, "_compute_logprobs", batch, temperature, include_reference, self.policy_version)

    def _compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                          version: int) -> LogProbs:
        """SPMD (`workers.spmd`): each rank its share of the micro-batches, gathered in token order."""
        return self.trainer.compute_logprobs(batch, temperature, include_reference, version)

    def update(self, step: int, policy_version: int, batch: SequenceBatch, targets: PolicyTargets,
               temperature: float) -> UpdateResult:
        """One policy update. A repeat of an applied step returns its recorded result unchanged."""
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        self._check_targets(batch, targets)
        temperature = require_temperature(temperature)

        return self.state.update(step, policy_version, lambda: spmd(self, "_train", batch, targets, temperature),
                                 max_lag=self.max_staleness)

    def _train(self, batch: SequenceBatch, targets: PolicyTargets, temperature: float) -> dict[str, float]:
        """SPMD: every rank steps its replica with the gradients summed over all ranks."""
        self.engine.sleep()  # the trainer needs the memory more than the engine's caches
        stats = self.trainer.update(batch, targets, temperature)
        stats["weight_sync_s"] = self._sync_weights()
        return stats

    @property
    def policy_version(self) -> int:
        return self.state.version

    @property
    def ledger(self) -> StepLedger:
        return self.state.ledger

    def _sync_weights(self) -> float:
        """Move the new weights into the rollout engine; the next Generate samples from them. Inside
        the ledger's `applying`: a failure here leaves the engine neither old nor new."""
        start = time.perf_counter()
        try:
            self.engine.load_weights(full_named_parameters(self.model))  # sharded: gathered, every rank
            self.engine.reset_cache()
            self.engine.wake()
        except Exception as exc:  # the trainer's weights moved: a retry must not apply the step again
            raise PartialUpdate(f"moving the new weights into the rollout engine failed ({exc})") from exc
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are asynchronous: time them whole
        seconds = time.perf_counter() - start
        metrics.WEIGHT_SYNC_SECONDS.labels(ROLE).observe(seconds)
        return seconds

    def _check_targets(self, batch: SequenceBatch, targets: PolicyTargets) -> None:
        batch.check_per_token(targets.advantages, "advantages", "target")
        batch.check_per_token(targets.old_logprobs, "old_logprobs", "logprob")
        if self.cfg.kl_loss_coef > 0 and targets.ref_logprobs is None:
            raise InvalidArgument("ref_logprobs", "required: actor.kl_loss_coef > 0 adds a KL loss term")
        if self.cfg.is_correction != "none" and targets.rollout_logprobs is None:
            raise InvalidArgument("rollout_logprobs", f"required by actor.is_correction={self.cfg.is_correction}")
        for name in ("ref_logprobs", "rollout_logprobs"):
            if getattr(targets, name) is not None:
                batch.check_per_token(getattr(targets, name), name, "logprob")

    # --- status / lifecycle -----------------------------------------------------------------------

    def status(self, include_digest: bool = False) -> RoleStatus:
        """A snapshot read without the model lock (a rollout or update may be in flight); hashing
        the weights waits for the lock and is done only when asked."""
        return RoleStatus(ROLE, self.policy_version, self.ledger.last_step,
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
            del self.engine, self.trainer, self.model, self.ref_model
        release_memory()

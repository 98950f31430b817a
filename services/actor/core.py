"""ActorCore: the actor role without gRPC, a controller over its workers (`actor/worker.py`):
request validation, the step ledger and version fence, the locks, and dispatch. Tests drive it
in-process; the servicer wraps it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from rolefleet.actor.completions import EndpointStats
from rolefleet.actor.sessions import SessionLimits, SessionStore
from rolefleet.actor.turns import TurnRenderer, check_observation, whole_responses, with_no_room
from rolefleet.actor.types import (
    SAMPLES_PER_GROUP_LIMIT,
    ActorUpdateResult,
    AgentTask,
    Continuation,
    LogProbs,
    PolicyTargets,
    Sample,
    SamplingParams,
    Trajectory,
    with_ids,
)
from rolefleet.actor.worker import ROLE, ActorWorker
from rolefleet.common import metrics
from rolefleet.common.batch import BatchLimits, SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.common.modeling import require_temperature
from rolefleet.common.role_types import CheckpointInfo
from rolefleet.common.stop_tokens import end_of_turn_id, merged
from rolefleet.common.top_k import TEACHER_TOP_FIELDS
from rolefleet.trainer import checkpoint, lora
from rolefleet.trainer.role import TrainerRole
from rolefleet.trainer.workers import WorkerGroup

MAX_GROUPS = 2**63 // SAMPLES_PER_GROUP_LIMIT  # group ids below it give int64 sample ids


class ActorCore(TrainerRole):
    def __init__(self, cfg: ActorSection, seed: int = 0, max_staleness: int = 0, rollout_ranks: tuple[int, ...] = (),
                 group: WorkerGroup | None = None):
        """`rollout_ranks`: the worker ranks that only generate (`placement.rollout_ranks`); empty:
        every rank trains and generates. `group`: the other worker processes, when the actor runs
        over several (`serve` starts them)."""
        self.cfg = cfg
        self.max_staleness = max_staleness  # updates an Update's oldest sample may lag (pipeline.max_staleness)
        worker = ActorWorker(cfg, seed, rollout_ranks)
        super().__init__(ROLE, worker, group, versioned="policy")
        self.tokenizer, self.vocab_size, self.stop_ids = worker.tokenizer, worker.vocab_size, worker.stop_ids
        self.max_positions = worker.max_positions
        # What one sequence may hold while generating: the vllm engine's KV cache may be sized below
        # the model's positions (`actor.rollout.vllm.max_model_len`).
        engine_len = cfg.rollout.vllm.max_model_len if worker.backend == "vllm" else None
        bounds = [p for p in (self.max_positions, engine_len) if p is not None]
        self.generate_positions = min(bounds) if bounds else None
        self.turns = TurnRenderer(self.tokenizer)
        self.end_of_turn = end_of_turn_id(self.tokenizer)  # where a multi-turn rollout's turn ends
        self.limits = BatchLimits.of(ROLE, cfg, self.max_positions)
        # Colocated, generation takes the trainer's lock (one model, used by one at a time); with the
        # engines apart it has its own, and only a weight sync takes both.
        apart = worker.transport.apart
        self._rollout_lock = threading.Lock() if apart else self._lock
        self._sync_lock = self._rollout_lock if apart else contextlib.nullcontext()  # colocated: held already
        self._one_pass_logprobs: tuple[int, LogProbs | None] = (0, None)  # (step, its update's logprobs)
        metrics.MODEL_VERSION.labels(ROLE).set(0)
        self._engine_said = ""
        # A version trained and not yet in the engines (`ActorSection.publishes_on_update` false:
        # the sft loss): published by the next generation, under the rollout lock.
        self._unpublished: int | None = None
        self.rollout_engine()
        # The endpoint's sessions (actor/openai_api.py); kept here, where the coordinator opens and closes them.
        self.sessions = SessionStore(self.tokenizer, SessionLimits(
            cfg.endpoint.max_sessions, cfg.rollout.max_total_tokens or cfg.rollout.max_turns * 4096,
            cfg.rollout.max_turns, cfg.endpoint.session_timeout_s, cfg.endpoint.agents_at_once),
            self.generate_positions)
        self.endpoint_stats = EndpointStats()  # the endpoint's, reported with every update

    # --- the endpoint's sessions ---------------------------------------------------------------------

    def open_sessions(self, ids: list[str], sampling: SamplingParams, tasks: list[AgentTask] | None = None) -> list[str]:
        """Sessions for agent-driven episodes, sampling with the run's `sampling` (every turn ends at
        the chat template's end-of-turn token); their keys. `tasks`: for agents outside the cluster
        to claim."""
        if not ids:
            raise InvalidArgument("session_ids", "no sessions given")
        return self.sessions.open(ids, replace(sampling, n=1, seed=-1, stop_at_end_of_turn=True), tasks)

    def session_rewards(self, ids: list[str]) -> list[float | None]:
        return self.sessions.rewards(ids)

    def close_sessions(self, ids: list[str]) -> list[Trajectory]:
        return self.sessions.close(ids)

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

    def generate(self, prompts: list[str], sampling: SamplingParams, first_group_id: int = 0,
                 continuations: list[Continuation] | None = None) -> list[Sample]:
        return [sample for chunk in self.generate_chunks(prompts, sampling, first_group_id, continuations)
                for sample in chunk]

    def generate_chunks(self, prompts: list[str], sampling: SamplingParams, first_group_id: int = 0,
                        continuations: list[Continuation] | None = None) -> Iterator[list[Sample]]:
        """Samples as each forward batch finishes, stamped with group ids from `first_group_id`.
        `continuations` (instead of prompts): conversations to continue by one turn each, whose
        samples' prompt_ids are the context followed by the rendered observation. Input is
        validated before the first chunk; the model stays locked until the iterator is exhausted
        or closed."""
        if sampling.stop_at_end_of_turn and self.end_of_turn is not None:
            sampling = replace(sampling, stop_token_ids=merged(sampling.stop_token_ids, [self.end_of_turn]))
        room: list[bool] = []
        if continuations:
            if prompts:
                raise InvalidArgument("prompts", "give prompts or continuations, not both")
            context_ids, room = self._validate_continuations(continuations, sampling)
            prompt_ids = [ids for ids, fits in zip(context_ids, room) if fits]
        else:
            prompt_ids = self._validate_generate(prompts, sampling)
        if first_group_id < 0:
            raise InvalidArgument("first_group_id", f"must be >= 0, got {first_group_id}")
        if first_group_id + len(prompt_ids) > MAX_GROUPS:  # else a sample id overflows int64 on the wire
            raise InvalidArgument("first_group_id", f"{first_group_id} + {len(prompt_ids)} prompts exceed {MAX_GROUPS} "
                                  f"groups: sample ids (group_id * {SAMPLES_PER_GROUP_LIMIT} + sample_index) are int64")
        chunks = self._locked_chunks(prompt_ids, sampling) if prompt_ids else iter(())
        if not all(room):
            chunks = with_no_room(chunks, context_ids, room, self.worker.rollout_version)
        if any(c.resume_from for c in continuations or ()):
            chunks = whole_responses(chunks, continuations, self.tokenizer)
        return (with_ids(chunk, first_group_id) for chunk in chunks)

    def _locked_chunks(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams) -> Iterator[list[Sample]]:
        """The engine's chunks, under the rollout lock until it has made the request's last sample:
        the caller's encoding and sending of that chunk (a message per sample; the GPU sat idle for
        50-60 ms of it at 256 samples, profiled) then holds up neither a weight sync nor the next
        request."""
        expected, made = len(prompt_ids) * sampling.n, 0
        self._rollout_lock.acquire()
        held, start = True, time.perf_counter()
        try:
            self._publish_pending()
            version = self.worker.rollout_version
            if self.workers.here_alone(ActorWorker.generate_share):
                # This process drives the only engine (alone, or the split actor's only rollout
                # worker): each engine call's samples stream as they finish.
                chunks = self.worker.engine_chunks(prompt_ids, sampling, version)
            else:  # each engine generates its share of the prompts; one chunk when all are done
                chunks = iter([self.workers.run(ActorWorker.generate_share, prompt_ids, sampling, version)])
            for chunk in chunks:
                metrics.TOKENS_GENERATED.labels(ROLE).inc(sum(len(s.response_ids) for s in chunk))
                made += len(chunk)
                if made >= expected:  # the engine is done with this request
                    held = False
                    self._rollout_lock.release()
                    metrics.ROLLOUT_SECONDS.labels(ROLE).observe(time.perf_counter() - start)
                    self.rollout_engine()  # (a decode loop that gave way to transformers' generate shows)
                yield chunk
        finally:
            if held:
                self._rollout_lock.release()

    def rollout_engine(self) -> str:
        """The engine generating now: this process's own, or with the engines on other ranks the
        backend they were built with; a change (a fallback) is said in the metric's label."""
        engine = self.worker.engine
        name = engine.name if engine is not None else self.worker.backend
        if name != self._engine_said:
            if self._engine_said:
                metrics.ROLLOUT_ENGINE.labels(ROLE, self._engine_said).set(0)
            metrics.ROLLOUT_ENGINE.labels(ROLE, name).set(1)
            self._engine_said = name
        return name

    def _validate_continuations(self, continuations: list[Continuation],
                                sampling: SamplingParams) -> tuple[list[torch.Tensor], list[bool]]:
        """Each conversation's ids followed by its rendered observation, checked like prompts, and
        whether it has room for `sampling.max_new_tokens` more under the model's positions. A full
        conversation is no bad input (a long observation can fill it): it gets an empty turn
        (`with_no_room`) rather than failing the request's other conversations."""
        self._validate_sampling(len(continuations), sampling)
        if sampling.n != 1:
            raise InvalidArgument("sampling.n", f"a continuation is one conversation: n must be 1, got {sampling.n}")
        ids = []
        for i, c in enumerate(continuations):
            field = f"continuations[{i}]"
            context = c.context_ids
            if context.dim() != 1 or not context.numel():
                raise InvalidArgument(f"{field}.context_ids", "must hold the conversation's tokens (int64 [C], C > 0)")
            if int(context.min()) < 0 or int(context.max()) >= self.vocab_size:
                raise InvalidArgument(f"{field}.context_ids", f"token ids must lie in [0, {self.vocab_size})")
            if c.resume_from:  # partial rollouts: generate on, nothing appended
                if not 0 < c.resume_from <= len(context):
                    raise InvalidArgument(f"{field}.resume_from", f"must lie in [1, {len(context)}] (where the "
                                          f"response began in context_ids), got {c.resume_from}")
                if c.observation:
                    raise InvalidArgument(f"{field}.observation", "a resumed response takes no observation")
                ids.append(context.to(torch.int64))
                continue
            check_observation(c.observation, f"{field}.observation", self.cfg.max_prompt_bytes)
            rendered = self.turns.observation_ids(c.observation, int(context[-1]), f"{field}.observation")
            ids.append(torch.cat([context.to(torch.int64), torch.tensor(rendered, dtype=torch.int64)]))
        limit = self.generate_positions
        if limit is not None and sampling.max_new_tokens >= limit:  # room for no conversation at all
            raise InvalidArgument("sampling.max_new_tokens", f"{sampling.max_new_tokens} new tokens leave no room "
                                  f"for a conversation within the model's {limit} positions")
        has_room = [limit is None or len(i) + sampling.max_new_tokens <= limit for i in ids]
        if fitting := [i for i, room in zip(ids, has_room) if room]:
            self._check_room(fitting, sampling)
        return ids, has_room

    def _check_room(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams) -> None:
        longest, limit = max(len(p) for p in prompt_ids), self.generate_positions
        if limit is not None and longest + sampling.max_new_tokens > limit:
            raise InvalidArgument("sampling.max_new_tokens", f"{sampling.max_new_tokens} new tokens after a "
                                  f"{longest}-token prompt exceed the model's {limit} positions")
        total = sum(len(p) for p in prompt_ids) + len(prompt_ids) * sampling.n * sampling.max_new_tokens
        if total > self.cfg.max_tokens_per_request:
            raise LimitExceeded("continuations", f"{total} context + new tokens exceed "
                                f"actor.max_tokens_per_request={self.cfg.max_tokens_per_request}")

    def _validate_sampling(self, sequences: int, sampling: SamplingParams) -> None:
        sampling.validate()
        for i, token in enumerate(sampling.stop_token_ids):
            if token >= self.vocab_size:
                raise InvalidArgument(f"sampling.stop_token_ids[{i}]", f"{token} is not below the model's vocabulary "
                                      f"size {self.vocab_size}")
        if sequences * sampling.n > self.cfg.max_sequences_per_request:
            raise LimitExceeded("sampling.n", f"{sequences} prompts x n={sampling.n} exceed "
                                f"actor.max_sequences_per_request={self.cfg.max_sequences_per_request}")

    def _validate_generate(self, prompts: list[str], sampling: SamplingParams) -> list[torch.Tensor]:
        self._validate_sampling(len(prompts), sampling)
        limit = self.generate_positions
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
            return self.workers.run(ActorWorker.compute_logprobs, batch, temperature, include_reference,
                                    not reference_only, self.policy_version)

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
        stats, logprobs = self.workers.run(ActorWorker.train, batch, targets, temperature)
        stats.update(self.endpoint_stats.take())  # what the endpoint's agents waited for since the last one
        if logprobs is not None:  # a one-pass update's: kept for its replay, the newest step's only
            self._one_pass_logprobs = (step, replace(logprobs, policy_version=self.state.version))
        if self.cfg.publishes_on_update:
            stats["weight_sync_s"] = self._publish_weights(self.state.version + 1)
        else:
            self._unpublished, stats["weight_sync_s"] = self.state.version + 1, 0.0
        metrics.COMPILED_GRAPHS.labels(ROLE).inc(stats["compiled_graphs"])
        return stats

    def _publish_pending(self) -> None:
        """The trained version into the engines before a generation samples (the rollout lock held:
        it is the sync's own lock apart, the trainer's colocated)."""
        if self._unpublished is not None:
            start = time.perf_counter()
            self.workers.run(ActorWorker.sync_weights, self._unpublished)
            metrics.WEIGHT_SYNC_SECONDS.labels(ROLE).observe(time.perf_counter() - start)
            self._unpublished = None

    @property
    def policy_version(self) -> int:
        return self.state.version

    def _publish_weights(self, version: int) -> float:
        """Move the new weights into every rollout engine; the next Generate samples from them and
        stamps `version`. Split placement waits for a generation in flight to finish first. Inside
        the ledger's `applying`: a failure here leaves the engines neither old nor new."""
        start = time.perf_counter()
        with self._sync_lock:
            self.workers.run(ActorWorker.sync_weights, version)
        seconds = time.perf_counter() - start
        metrics.WEIGHT_SYNC_SECONDS.labels(ROLE).observe(seconds)
        return seconds

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
        if self.cfg.teacher_kl_coef > 0 and targets.teacher_top is None:
            raise InvalidArgument(TEACHER_TOP_FIELDS[0], "required: actor.teacher_kl_coef > 0 adds the teacher's "
                                  "KL term (teacher.top_k)")
        if targets.teacher_top is not None:
            targets.teacher_top.check(batch, TEACHER_TOP_FIELDS, self.vocab_size)

    # --- checkpoints (trainer/role.py) -----------------------------------------------------------

    def write_hf_files(self, work) -> None:
        checkpoint.save_hf_files(work, self.worker.model_config, self.tokenizer)
        if self.cfg.lora.enabled:  # which base model the saved adapters belong to
            lora.save_config(Path(work) / "hf", self.cfg.lora, self.cfg.model_name_or_path)

    def after_load(self, info: CheckpointInfo) -> None:
        """The rollout engines take the loaded weights and version."""
        with self.ledger.applying(info.step):  # engines left half loaded: refuse updates until restarted
            self._publish_weights(info.model_version)
            self._unpublished = None

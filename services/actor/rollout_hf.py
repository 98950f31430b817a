"""The `hf` rollout engine: transformers models over the engine's own copy of the policy.

The copy is bf16 on CUDA (decoding is bound by reading weights: half the bytes of fp32) and fp32 on
the CPU; `load_weights` refreshes it from the trainer after every update. Decoding runs in the
engine's own loop (`decode.py`: its KV cache, sampling and logprobs on the device, a CUDA graph per
step). Models whose attention the loop cannot serve fall back to transformers' `generate`, which
keeps no per-step logits (its `output_logits` holds [steps, batch, vocab] fp32: 40 GB for 256 x 256
tokens of a 151k vocabulary); their logprobs come from one more forward of the same copy, chunk by
chunk through the LM head. Either way the recorded logprob follows the project's convention:
log softmax(logits / temperature), before top-k / top-p truncation.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.actor.decode import DecodeLoop, UnsupportedModel
from rolefleet.actor.decode_budget import DecodeBudget, DeviceRoom
from rolefleet.actor.rollout import RolloutEngine, derived_seed
from rolefleet.actor.types import FinishReason, Sample, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.modeling import compile_decoder_layers, lm_logprobs, load_causal_lm
from rolefleet.common.stop_tokens import merged
from rolefleet.trainer.loading import is_pending

log = logging.getLogger(__name__)


def _engine_copy(policy: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of the policy whose parameters are `dtype`, made without a transient full-precision
    copy: each parameter's cast copy is placed in deepcopy's memo first (tied weights share one).
    Buffers keep their dtype: RoPE frequencies in bf16 would be off by radians at long positions."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in policy.parameters()}
    engine = copy.deepcopy(policy, memo).eval()
    for module in engine.modules():
        # A compiled module's compiled call is a closure over the *original* module: copied as is,
        # the copy would run the policy's own weights.
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    return engine


class HFRolloutEngine(RolloutEngine):
    def __init__(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                 cfg: ActorSection, dtype: torch.dtype | None, stop_ids: tuple[int, ...]):
        """`stop_ids`: the checkpoint's own (`stop_tokens.checkpoint_stop_ids`); each request may add more."""
        if policy is None or is_pending(policy):  # a rollout rank, or a trainer's shards still to be read
            self.model = load_causal_lm(cfg.model_name_or_path, device, dtype or torch.float32,
                                        bool(cfg.trust_remote_code)).eval()
        else:
            self.model = _engine_copy(policy, dtype or torch.float32)
        self.stop_ids = stop_ids
        # The checkpoint's generation defaults (a repetition penalty, say) would reshape the sampling
        # distribution behind the recorded logprobs: only the request's sampling parameters apply.
        self.model.generation_config = GenerationConfig()
        if cfg.compile_layers:
            compile_decoder_layers(self.model)
        self.tokenizer = tokenizer
        self.device = device
        self.cfg = cfg
        keep = cfg.rollout.keep_decode_state_mb
        self._budget = DecodeBudget(None if keep == "auto" else keep * 2**20,
                                    DeviceRoom(device) if device.type == "cuda" else None)
        self._loop = None if cfg.rollout.decode == "generate" else DecodeLoop(
            self.model, device, tokenizer.pad_token_id, cfg.max_tokens_per_micro_batch, compile=cfg.compile_layers,
            budget=self._budget, compact=cfg.rollout.compact)

    @property
    def name(self) -> str:
        return "hf" if self._loop is not None else "hf (transformers generate)"

    # --- weights and memory -------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            params[name].copy_(tensor)  # casts fp32 master weights to the engine's dtype

    def sleep(self) -> None:
        # KV caches and captured graphs over the budget for an update (`decode_budget.py`) go back to
        # this process's allocator, where the trainer reuses them. Not `empty_cache`: the trainer would
        # pay cudaMalloc (and the device-wide sync of cudaFree) for every block again, about 60 ms per
        # update at 0.5B on an H200. Those within it stay: building one again at the next call (a
        # warm-up step and a capture, cuDNN's plans and the compiled layers' guards on the host) cost
        # about 0.2 s a call with SmolLM2-135M, whose whole call is 46 ms of GPU work. A graph reads
        # the engine's own parameters, which `load_weights` refreshes in place, so it stays valid.
        if self._loop is not None:
            self._loop.trim(self._budget.for_update(self._loop.held_bytes()))
            self._budget.update_starts()

    def wake(self) -> None:
        self._budget.update_done()  # what the update added beside the kept state: the next sleep's budget

    def take_stats(self) -> dict[str, float]:
        if self._loop is None:
            return {}
        built, self._loop.built = self._loop.built, 0
        return {"decode_shapes_built": float(built), "decode_state_gib": self._loop.held_bytes() / 2**30}

    # `reset_cache`: nothing to do (the kept decode state is valid, no prefix cache survives a call).

    # --- generation ----------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                 policy_version: int) -> Iterator[list[Sample]]:
        """n samples for each prompt, prompt-major, yielded one forward batch (`rollout.batch_size`
        sequences) at a time so callers can stream finished samples. prompt_ids: list of int64 [P_i]."""
        jobs = [(p, s) for p in range(len(prompt_ids)) for s in range(sampling.n)]
        batch_size = self.cfg.rollout.batch_size
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            # Each forward batch its own seed: the decode loop seeds after capturing its graph.
            with torch.no_grad():
                yield self._generate_chunk(chunk, prompt_ids, replace(sampling, seed=derived_seed(sampling.seed, start)),
                                           policy_version)

    def _generate_chunk(self, chunk, prompt_ids, sampling: SamplingParams, policy_version: int) -> list[Sample]:
        prompts = [prompt_ids[p] for p, _ in chunk]
        stops = merged(self.stop_ids, sampling.stop_token_ids)
        generated, logprobs = self._sample(prompts, sampling, stops)
        # Each row up to and including its first stop token (the policy is trained to stop), found
        # for the whole batch at once, and the texts decoded in one batch.
        stop = torch.isin(generated, torch.tensor(stops, dtype=generated.dtype))
        stopped = stop.any(dim=1)
        lengths = torch.where(stopped, stop.int().argmax(dim=1) + 1, generated.shape[1]).tolist()
        responses = [row[:n] for row, n in zip(generated, lengths)]
        texts = self.tokenizer.batch_decode([r.tolist() for r in responses], skip_special_tokens=True)
        return [Sample(prompt_index=p, sample_index=s, prompt_ids=prompt, response_ids=response.clone(),
                       logprobs=row_logprobs[:len(response)].clone(),
                       finish_reason=FinishReason.STOP if stop else FinishReason.LENGTH,
                       policy_version=policy_version, response_text=text)
                for (p, s), prompt, response, row_logprobs, stop, text
                in zip(chunk, prompts, responses, logprobs, stopped.tolist(), texts)]

    def _sample(self, prompts: list[torch.Tensor], sampling: SamplingParams,
                stops: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Generated tokens [b, T] and their logprobs [b, T] (cpu)."""
        if self._loop is not None:
            try:
                out = self._loop.run(prompts, sampling.temperature, sampling.top_k, sampling.top_p,
                                     sampling.max_new_tokens, sampling.seed, stops)
                return out.tokens, out.logprobs
            except UnsupportedModel as exc:
                if self.cfg.rollout.decode == "loop":
                    raise
                log.warning("actor.rollout.decode=auto: %s; falling back to transformers' generate", exc)
                self._loop = None
        if sampling.seed >= 0:
            torch.manual_seed(sampling.seed)
        generated = self._generate(prompts, sampling, stops)
        batch = SequenceBatch.from_lists(prompts, list(generated))
        logprobs = self._logprobs(batch, 1.0 if sampling.greedy else sampling.temperature).view(len(prompts), -1)
        return generated, logprobs

    def _generate(self, prompts: list[torch.Tensor], sampling: SamplingParams, stops: tuple[int, ...]) -> torch.Tensor:
        """transformers' `generate` (models the decode loop cannot serve): tokens [b, T] (cpu) after
        left-padded prompts; every row's next token is generated at the same position."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = p
            attention_mask[i, width - len(p):] = 1
        drawn = {} if sampling.greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p,
                                                top_k=sampling.top_k)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            do_sample=not sampling.greedy, **drawn, max_new_tokens=sampling.max_new_tokens, pad_token_id=pad,
            eos_token_id=list(stops) or None,
        )
        return out[:, width:].cpu()

    def _logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        """Packed logprobs [N] of the sampled tokens under the engine's own weights."""
        (logprobs,) = batch.map_micro_batches(self.cfg.max_tokens_per_micro_batch, lambda mb: lm_logprobs(
            self.model, mb, self.device, temperature, self.cfg.logprob_chunk_tokens, with_entropy=False,
            compile=self.cfg.compile_layers)[:1])
        return logprobs


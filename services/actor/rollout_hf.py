"""Rollout engine on transformers' `generate`, over the engine's own copy of the policy.

The copy is bf16 on CUDA (the decode loop is bound by reading weights: half the bytes of fp32) and
fp32 on the CPU; `load_weights` refreshes it from the trainer after every update. Sampling keeps no
per-step logits (transformers' `output_logits` holds [steps, batch, vocab] fp32: 40 GB for 256 x 256
tokens of a 151k vocabulary); the logprob of each sampled token is computed afterwards by one forward
of the same copy over prompt + response, chunk by chunk through the LM head, under the project's
convention: log softmax(logits / temperature), before top-k / top-p truncation.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.actor.types import FinishReason, Sample, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.modeling import lm_logprobs, release_memory


def _engine_copy(policy: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of the policy whose parameters are `dtype`, made without a transient full-precision
    copy: each parameter's cast copy is placed in deepcopy's memo first (tied weights share one).
    Buffers keep their dtype: RoPE frequencies in bf16 would be off by radians at long positions."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in policy.parameters()}
    return copy.deepcopy(policy, memo).eval()


class HFRolloutEngine:
    def __init__(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                 cfg: ActorSection, dtype: torch.dtype | None):
        self.model = _engine_copy(policy, dtype or torch.float32)
        # The checkpoint's generation defaults (a repetition penalty, say) would reshape the sampling
        # distribution behind the recorded logprobs: only the request's sampling parameters apply.
        self.model.generation_config = GenerationConfig()
        self.tokenizer = tokenizer
        self.device = device
        self.cfg = cfg

    # --- weights and memory -------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            params[name].copy_(tensor)  # casts fp32 master weights to the engine's dtype

    def sleep(self) -> None:
        release_memory()  # transformers' caches live per call: only the allocator's cache is left

    def wake(self) -> None:
        pass

    def reset_cache(self) -> None:
        pass  # no prefix cache survives a call

    # --- generation ----------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                 policy_version: int) -> Iterator[list[Sample]]:
        """n samples for each prompt, prompt-major, yielded one forward batch (`rollout_batch_size`
        sequences) at a time so callers can stream finished samples. prompt_ids: list of int64 [P_i]."""
        if sampling.seed >= 0:
            torch.manual_seed(sampling.seed)
        jobs = [(p, s) for p in range(len(prompt_ids)) for s in range(sampling.n)]
        batch_size = self.cfg.rollout_batch_size
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            with torch.no_grad():
                yield self._generate_chunk(chunk, prompt_ids, sampling, policy_version)

    def _generate_chunk(self, chunk, prompt_ids, sampling: SamplingParams, policy_version: int) -> list[Sample]:
        prompts = [prompt_ids[p] for p, _ in chunk]
        generated = self._sample(prompts, sampling)
        responses, reasons = zip(*(self._response(row) for row in generated))
        batch = SequenceBatch.from_lists(prompts, list(responses))
        logprobs = self._logprobs(batch, sampling.temperature).split(batch.response_lengths.tolist())
        return [
            Sample(prompt_index=p, sample_index=s, prompt_ids=prompt, response_ids=response,
                   logprobs=lp, finish_reason=reason, policy_version=policy_version,
                   response_text=self.tokenizer.decode(response, skip_special_tokens=True))
            for (p, s), prompt, response, lp, reason in zip(chunk, prompts, responses, logprobs, reasons)
        ]

    def _sample(self, prompts: list[torch.Tensor], sampling: SamplingParams) -> torch.Tensor:
        """Generated tokens [b, T] (cpu) after left-padded prompts: every row's next token is
        generated at the same position."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = p
            attention_mask[i, width - len(p):] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_new_tokens=sampling.max_new_tokens, pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id,
            cache_implementation=self.cfg.rollout_cache if self.cfg.rollout_cache != "dynamic" else None,
        )
        return out[:, width:].cpu()

    def _logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        """Packed logprobs [N] of the sampled tokens under the engine's own weights."""
        (logprobs,) = batch.map_micro_batches(self.cfg.max_tokens_per_micro_batch, lambda mb: lm_logprobs(
            self.model, mb, self.device, temperature, self.cfg.logprob_chunk_tokens, with_entropy=False)[:1])
        return logprobs

    def _response(self, tokens: torch.Tensor) -> tuple[torch.Tensor, FinishReason]:
        """Tokens up to and including the first EOS (the policy is trained to stop)."""
        eos = (tokens == self.tokenizer.eos_token_id).nonzero()
        if len(eos):
            return tokens[: int(eos[0]) + 1].clone(), FinishReason.STOP
        return tokens.clone(), FinishReason.LENGTH

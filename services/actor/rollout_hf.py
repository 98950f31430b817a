"""Rollout engine on transformers' `generate`.

It samples with the very module the trainer updates (the hybrid engine: weights move in memory, no
reload), and records the logprob of each sampled token under softmax(logits / temperature), the
same quantity the trainer recomputes, so rollout/train mismatch stays measurable.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.actor.types import FinishReason, Sample, SamplingParams
from rolefleet.common.modeling import token_logprobs


class HFRolloutEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                 batch_size: int):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.batch_size = batch_size

    def generate(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                 policy_version: int) -> Iterator[list[Sample]]:
        """n samples for each prompt, prompt-major, yielded one forward batch (`batch_size` sequences)
        at a time so callers can stream finished samples. prompt_ids: list of int64 [P_i]."""
        if sampling.seed >= 0:
            torch.manual_seed(sampling.seed)
        jobs = [(p, s) for p in range(len(prompt_ids)) for s in range(sampling.n)]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(jobs), self.batch_size):
                chunk = jobs[start : start + self.batch_size]
                with torch.no_grad():
                    samples = self._generate_chunk(chunk, prompt_ids, sampling, policy_version)
                yield samples
        finally:
            self.model.train(was_training)

    def _generate_chunk(self, chunk, prompt_ids, sampling: SamplingParams, policy_version: int) -> list[Sample]:
        prompts = [prompt_ids[p] for p, _ in chunk]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        # Left padding: every row's next token is generated at the same position.
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = p
            attention_mask[i, width - len(p):] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        generated = out.sequences[:, width:]                                 # [b, T]
        # Per generated position, so the [b, T, V] logits are never held at once.
        logprobs = torch.stack([token_logprobs(step_logits, generated[:, t], sampling.temperature)
                                for t, step_logits in enumerate(out.logits)], dim=1).cpu()  # [b, T]
        generated = generated.cpu()
        samples = []
        for i, (prompt_index, sample_index) in enumerate(chunk):
            length, reason = self._response_length(generated[i])
            response = generated[i, :length].clone()
            samples.append(Sample(
                prompt_index=prompt_index,
                sample_index=sample_index,
                prompt_ids=prompts[i],
                response_ids=response,
                logprobs=logprobs[i, :length].clone(),
                finish_reason=reason,
                policy_version=policy_version,
                response_text=self.tokenizer.decode(response, skip_special_tokens=True),
            ))
        return samples

    def _response_length(self, tokens: torch.Tensor) -> tuple[int, FinishReason]:
        """Tokens up to and including the first EOS (the policy is trained to stop)."""
        eos = (tokens == self.tokenizer.eos_token_id).nonzero()
        if len(eos):
            return int(eos[0]) + 1, FinishReason.STOP
        return len(tokens), FinishReason.LENGTH

"""Policy trainer: recomputes logprobs and applies policy-gradient updates.

Sequences are grouped into mini-batches (one optimizer step each) for `ppo_epochs` passes; each
mini-batch runs as micro-batches of at most `max_tokens_per_micro_batch` padded tokens whose
gradients accumulate, weighted so the step equals one over the whole mini-batch (see
`aggregation_weight`). Logprobs and entropy come from the LM head a chunk of tokens at a time, so
no [tokens, vocab] fp32 tensor exists for a batch. On CUDA, forwards and backwards run under bf16
autocast over fp32 master weights. The loss: the configured policy loss (optionally importance-
weighted against the rollout engine) - entropy_coef * entropy + kl_loss_coef * KL(policy || reference)
+ teacher_kl_coef * KL to the teacher over its most likely tokens (on-policy distillation), all
aggregated the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from rolefleet.actor.types import LogProbs, PolicyTargets
from rolefleet.algos import IS_CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, TEACHER_KL, aggregate, aggregation_weight
from rolefleet.algos.functional import masked_mean
from rolefleet.common import packed_attention
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ActorSection
from rolefleet.common.errors import FailedPrecondition
from rolefleet.common.modeling import compile_decoder_layers, compute_dtype, decoder_layers, lm_logprobs
from rolefleet.common.top_k import TopK
from rolefleet.trainer.base import Trainer
from rolefleet.trainer.host_memory import HostResident
from rolefleet.trainer.lora import Adapters, merged_weights
from rolefleet.trainer.ranks import Ranks
from rolefleet.trainer.sharding import full_named_parameters, shard, sharding_wanted


class LogprobModule(torch.nn.Module):
    """A causal LM whose forward is `lm_logprobs` (backbone, then the LM head a chunk of tokens at a
    time). One module, so that sharded (FSDP) its root unit's forward hook gathers the embeddings
    and the head, which calling the backbone and the head separately would skip."""

    def __init__(self, model: PreTrainedModel, chunk_tokens: int, packed: bool, compile: bool, attention: str):
        super().__init__()
        # Not `self.compile`: that is nn.Module's method.
        self.model, self.chunk_tokens, self.packed, self.compile_head = model, chunk_tokens, packed, compile
        self.attention = attention  # of packed micro-batches (packed_attention.resolve)

    def forward(self, batch: SequenceBatch, device: torch.device, temperature: float, with_entropy: bool,
                entropy_grad: bool = True, also: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return lm_logprobs(self.model, batch, device, temperature, self.chunk_tokens, with_entropy, self.packed,
                           entropy_grad, self.compile_head, self.attention, also)


class PolicyTrainer(Trainer):
    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel | None, device: torch.device,
                 cfg: ActorSection, seed: int, ranks: Ranks | None = None):
        """`ref_model`: the reference policy; None with `actor.lora`, whose reference is `model`
        with its adapters switched off."""
        if cfg.loss_norm_length is None:  # the config fills it in; a default per micro-batch width would be wrong
            raise ValueError("actor.loss_norm_length must be set (the config defaults it to sampling.max_new_tokens)")
        ranks = ranks or Ranks.alone()
        self.adapters = None
        if cfg.lora.enabled:  # before the trainer shards and builds its optimizer: only the adapters train
            frozen_dtype = None if sharding_wanted(cfg, ranks) else compute_dtype(device, cfg.compute_dtype)
            self.adapters = Adapters(model, cfg.lora, frozen_dtype)
        elif ref_model is None and cfg.holds_reference:
            raise ValueError("a reference model is needed: only actor.lora's reference is the policy itself "
                             "(and a supervised loss needs none)")
        attention = packed_attention.resolve(cfg.packed_attention, device)
        policy = LogprobModule(model, cfg.logprob_chunk_tokens, cfg.sequence_packing, cfg.compile_layers, attention)
        super().__init__(model, policy, model, cfg, device, ranks, seed)
        self.policy, self.ref_model = policy, ref_model
        self.reference = policy
        # Unsharded, an offloaded reference waits in pinned host memory (sharded: FSDP's offload policy).
        self._ref_host = None
        if ref_model is not None and cfg.ref_offload and not self.sharded:
            self._ref_host = HostResident(ref_model, pin=device.type == "cuda")
        if ref_model is not None:
            self.reference = LogprobModule(ref_model, cfg.logprob_chunk_tokens, self.packed, cfg.compile_layers,
                                           attention)
            if self.sharded:
                shard(self.reference, decoder_layers(ref_model), device, self.dtype, ranks, offload=cfg.ref_offload)
            if cfg.compile_layers:
                compile_decoder_layers(ref_model, hooks_outside=self.sharded)
        self.policy_loss = POLICY_LOSSES.get(cfg.policy_loss)
        self.is_correction = IS_CORRECTIONS.get(cfg.is_correction)
        self.kl_loss = KL_ESTIMATORS.get(cfg.kl_loss_estimator)
        self.teacher_kl = TEACHER_KL.get(cfg.teacher_kl)
        entropy = cfg.entropy_coef > 0

        def reference(mb: SequenceBatch) -> torch.Tensor:
            with self._reference_on_device():
                return self.forward(self.reference, mb, 1.0, with_entropy=False)[0]

        self.warm_compile([
            # The update (its entropy metric or loss term: a one-pass update always computes one)...
            (True, lambda mb: self.forward(self.policy, mb, 1.0, with_entropy=entropy, entropy_grad=entropy)[0]),
            (True, lambda mb: self.forward(self.policy, mb, 1.0, with_entropy=True, entropy_grad=entropy)[0]),
            # (with the teacher's KL term, the head's maths on k more tokens a position, for both; one
            # k serves any: the teacher's 5 or 8 compile nothing after it, tests/actor/test_trainer.py, test_gpu.py)
            *([(True, lambda mb, e=e: self.forward(self.policy, mb, 1.0, with_entropy=e, entropy_grad=entropy,
                                                   also=mb.response_ids[:, None].repeat(1, 2))[0])
               for e in {entropy, True}] if cfg.teacher_kl_coef > 0 else []),
            # ... and ComputeLogProbs: the policy's, the reference's.
            (False, lambda mb: self.forward(self.policy, mb, 1.0, with_entropy=True)[0]),
            (False, reference),
        ])

    def engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a rollout engine holding the plain model loads after an update, as (name, tensor):
        every weight, or with adapters each adapted layer's merged weight (`lora.merged_weights`).
        Sharded, a gather every training rank takes part in."""
        return full_named_parameters(self.model) if self.adapters is None else merged_weights(self.model)

    def forward(self, module: LogprobModule, batch: SequenceBatch, temperature: float, with_entropy: bool,
                entropy_grad: bool = True, also: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed logprobs [N] (and entropy [N]) of the batch's response tokens under `module`;
        `also` (int64 [N, k]): and of k more tokens a position, [N, 1 + k] (`lm_logprobs`)."""
        with self.autocast():
            return module(batch, self.device, temperature, with_entropy, entropy_grad, also)

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                         policy_version: int, include_policy: bool = True) -> LogProbs:
        """Over the worker group (each rank its share of the micro-batches, every rank the whole
        result)."""
        self.model.eval()
        logprobs = entropy = ref = None
        if include_policy:
            logprobs, entropy = self.map_micro_batches(
                batch, lambda mb: self.forward(self.policy, mb, temperature, with_entropy=True))
        if include_reference:
            with self._reference_on_device():  # one visit of an offloaded reference per call
                (ref,) = self.map_micro_batches(
                    batch, lambda mb: self.forward(self.reference, mb, temperature, with_entropy=False)[:1])
        return LogProbs(logprobs=logprobs, ref_logprobs=ref, entropy=entropy, policy_version=policy_version)

    @contextlib.contextmanager
    def _reference_on_device(self):
        """With adapters, the reference is the policy with them switched off. With `ref_offload`, a
        reference model lives in pinned host memory and visits the GPU per use, nothing copied back
        (sharded: FSDP's offload policy moves each unit's shards per forward)."""
        if self.ref_model is None and self.adapters is None:
            raise FailedPrecondition("the actor holds no reference model: algorithm sft trains without one")
        if self.ref_model is None:
            with self.adapters.off():
                yield
        elif self._ref_host is not None:
            with self._ref_host.visit(self.device):
                yield
        else:
            yield

    def update(self, batch: SequenceBatch, targets: PolicyTargets,
               temperature: float) -> tuple[dict[str, float], LogProbs | None]:
        """Policy-loss epochs over mini-batches; returns each statistic averaged over optimizer steps.
        Without old logprobs (one pass: one optimizer step, `ActorSection.one_pass_problem`) the
        forward's own, detached, are the old ones (the ratio is 1, its gradient the policy
        gradient), and they come back with the forward's entropy, in the batch's token order."""
        # (tokens, (logprobs, entropy)); a supervised loss reads no old logprobs, whatever the optimizer steps.
        one_pass: list | None = [] if targets.old_logprobs is None and not self.cfg.supervised else None

        def step(mb: SequenceBatch, tokens: torch.Tensor) -> dict[str, float]:
            def part(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else mb.pad_responses(x[tokens]).to(self.device)

            top = targets.teacher_top
            stats, seen = self._step(mb, part(targets.advantages), part(targets.old_logprobs),
                                     part(targets.ref_logprobs), part(targets.rollout_logprobs), temperature,
                                     None if top is None else top.map(part))
            if one_pass is not None:
                one_pass.append((tokens, self.ranks.merge(mb, seen)))
            return stats

        stats = self.run_epochs(batch, step)
        if one_pass is None:
            return stats, None
        (tokens, (logprobs, entropy)), = one_pass  # one mini-batch, its rows in a shuffled order
        in_order = torch.empty_like(logprobs), torch.empty_like(entropy)
        in_order[0][tokens], in_order[1][tokens] = logprobs, entropy
        return stats, LogProbs(logprobs=in_order[0], ref_logprobs=None, entropy=in_order[1], policy_version=0)

    def _step(self, mb: SequenceBatch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
              ref_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor | None,
              temperature: float, teacher_top: TopK | None = None) -> tuple[dict[str, float], list]:
        """One optimizer step over a mini-batch (padded [b, R] targets; the teacher's top tokens
        [b, R, k]). Each micro-batch's share is
        its part of the loss aggregation's weight (`actor.loss_agg_mode`). Also returns, for a
        one-pass update (no `old_logprobs`), this rank's (rows, (logprobs, entropy)) per micro-batch."""
        cfg, mask = self.cfg, mb.train_mask().to(self.device)  # the model's tokens only (multi-turn)
        weights, stats, seen = None, {}, []
        own = mask.sum().clamp(min=1)  # the model's tokens, before the correction may drop some
        if rollout_logprobs is not None and old_logprobs is not None:
            # Before the micro-batches: the correction may drop tokens, which changes the divisor.
            weights, mask = self.is_correction(old_logprobs, rollout_logprobs, mask, cfg.is_threshold)
            if self.ranks.first:  # mini-batch-wide statistics: once in the ranks' sum
                stats["is_weight_mean"] = masked_mean(weights, mask)
        if rollout_logprobs is not None and self.ranks.first:
            stats["is_masked_frac"] = 1.0 - mask.sum() / own
        rows_of = [(rows, _rows_of(rows.to(self.device), int(mb.response_lengths[rows].max())))
                   for rows in self.micro_batches(mb)]
        # One host sync for every share: the aggregation weights of the mini-batch and of each part.
        total, *parts = torch.stack([aggregation_weight(mask, cfg.loss_agg_mode)]
                                    + [aggregation_weight(part(mask), cfg.loss_agg_mode) for _, part in rows_of]).tolist()
        part_of = {id(rows): part for rows, part in rows_of}
        tokens = mask.sum().clamp(min=1)

        def micro_loss(rows: torch.Tensor, real: bool) -> tuple[torch.Tensor, dict]:
            part = part_of[id(rows)]
            loss, micro_stats, own = self._micro_loss(
                mb.select(rows), part(advantages), part(old_logprobs), part(ref_logprobs), part(weights), part(mask),
                temperature, part(rollout_logprobs), None if teacher_top is None else teacher_top.map(part))
            if own is not None and real:
                logprobs, entropy, micro_weights = own
                seen.append((rows, (logprobs, entropy)))
                if micro_weights is not None:  # their mean over the mini-batch's tokens, a part per micro-batch
                    stats["is_weight_mean"] = stats.get("is_weight_mean", 0.0) + (micro_weights * part(mask)).sum() / tokens
            return loss, micro_stats

        shares = [weight / max(total, 1.0) for weight in parts]
        return self.optimizer_step([(rows, share) for (rows, _), share in zip(rows_of, shares)], micro_loss, stats), seen

    def _micro_loss(self, mb: SequenceBatch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
                    ref_logprobs: torch.Tensor | None, weights: torch.Tensor | None, mask: torch.Tensor,
                    temperature: float, rollout_logprobs: torch.Tensor | None, teacher_top: TopK | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple | None]:
        """The micro-batch's loss and statistics; for a one-pass update (no `old_logprobs`), also
        its packed logprobs and entropy and its IS weights (None without a correction).
        `teacher_top` (padded [b, R, k]): the teacher's most likely tokens, for its KL term."""
        cfg = self.cfg
        one_pass = old_logprobs is None
        # Entropy costs more passes over [tokens, vocab] (and their backward): computed here only as
        # a loss term, or for the `entropy` metric of a one-pass update (then without a graph, once);
        # otherwise the metric comes from ComputeLogProbs.
        also = None if teacher_top is None else mb.pack_responses(teacher_top.ids)
        packed, entropy = self.forward(self.policy, mb, temperature, with_entropy=cfg.entropy_coef > 0 or one_pass,
                                       entropy_grad=cfg.entropy_coef > 0, also=also)
        if also is not None:  # the sampled tokens' logprobs, then the policy's of the teacher's top k
            packed, top = packed[:, 0], mb.pad_responses(packed[:, 1:])
        logprobs = mb.pad_responses(packed)
        if one_pass:
            # The policy before this update's only optimizer step is the proximal policy itself.
            old_logprobs = logprobs.detach()
            if rollout_logprobs is not None:
                weights, _ = self.is_correction(old_logprobs, rollout_logprobs, mask, cfg.is_threshold)
        loss, pg_stats = self.policy_loss(
            logprobs, old_logprobs, advantages, mask, clip_low=cfg.clip_ratio, clip_high=cfg.clip_ratio_high,
            dual_clip=cfg.dual_clip, agg=cfg.loss_agg_mode, weights=weights, norm_length=cfg.loss_norm_length,
        )
        stats = {"pg_loss": loss.detach(), **pg_stats}
        if cfg.entropy_coef > 0:
            entropy_term = aggregate(mb.pad_responses(entropy), mask, cfg.loss_agg_mode, cfg.loss_norm_length)
            stats["entropy"] = entropy_term.detach()
            loss = loss - cfg.entropy_coef * entropy_term
        if cfg.kl_loss_coef > 0:
            kl = aggregate(self.kl_loss(logprobs, ref_logprobs), mask, cfg.loss_agg_mode, cfg.loss_norm_length)
            loss = loss + cfg.kl_loss_coef * kl
            stats["kl_loss"] = kl.detach()
        if teacher_top is not None:
            teacher_kl = aggregate(self.teacher_kl(teacher_top.logprobs, top), mask, cfg.loss_agg_mode,
                                   cfg.loss_norm_length)
            loss = loss + cfg.teacher_kl_coef * teacher_kl
            stats["teacher_kl"] = teacher_kl.detach()
        stats["loss"] = loss.detach()
        seen = (packed.detach(), entropy.detach(), weights) if one_pass else None
        return loss, stats, seen


def _rows_of(rows: torch.Tensor, width: int):
    """Slice a mini-batch's padded [b, R] tensor to a micro-batch's rows and response width."""
    def part(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[rows, :width]

    return part

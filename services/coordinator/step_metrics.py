"""One step's metrics record (the keys of metrics.jsonl; docs/metrics.md describes each)."""

from __future__ import annotations

from typing import Optional

import torch

from rolefleet.actor.types import FinishReason, LogProbs, Sample
from rolefleet.algos import logprob_mismatch
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.role_types import UpdateResult
from rolefleet.coordinator.targets import Targets
from rolefleet.reward.types import ScoreResult
from rolefleet.teacher.types import TeacherLogProbs


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


# Steps whose compiles are expected: the first shapes of each pass (update, logprob passes, value
# passes). A compile after them is a recompile: a shape no graph covers, seconds of a stalled step.
COMPILE_WARMUP_STEPS = 3


def late_compile(record: dict) -> str | None:
    """The warning for a step that compiled after warm-up, or None."""
    if record["step"] <= COMPILE_WARMUP_STEPS or not record.get("compile/graphs"):
        return None
    return (f"step {record['step']}: the trainers compiled {record['compile/graphs']:g} graph(s) in "
            f"{record['compile/seconds']:.1f} s after warm-up (a micro-batch shape no graph covered: "
            "TORCH_LOGS=recompiles in the trainer names the guard that failed)")


def distill_metrics(batch: SequenceBatch, logprobs: torch.Tensor | None, samples: list[Sample],
                    teacher: TeacherLogProbs) -> dict[str, float]:
    """How far the student is from its teacher where it samples: the mean per-token reverse KL
    estimate (student minus teacher logprob, k1) over the model's own tokens, and the teacher's
    mean logprob of them; with the teacher's top k, the mean probability they hold (how much of the
    teacher's distribution the forward-KL term sees)."""
    own = batch.packed_train_mask()
    student = logprobs if logprobs is not None else torch.cat([s.logprobs for s in samples])
    record = {"distill/reverse_kl": (student - teacher.logprobs)[own].mean().item(),
              "distill/teacher_logprob": teacher.logprobs[own].mean().item()}
    if teacher.top is not None:
        record["distill/teacher_top_k_mass"] = teacher.top.logprobs[own].exp().sum(1).mean().item()
    return record


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): how much of the return variance the critic explains."""
    var = returns.var()
    return (1.0 - (returns - values).var() / var).item() if var > 0 else 0.0


def step_record(step: int, actor: UpdateResult, critic: Optional[UpdateResult], batch: SequenceBatch,
                samples: list[Sample], reward: ScoreResult, values: torch.Tensor, logprobs: LogProbs,
                targets: Targets, seconds: dict[str, float]) -> dict:
    rollout_logprobs = torch.cat([s.logprobs for s in samples])
    own = batch.packed_train_mask()  # multi-turn: the model's tokens (observations are no samples of it)
    mismatch_mean, mismatch_max = logprob_mismatch(logprobs.logprobs, rollout_logprobs, own.float())
    lengths = batch.response_lengths.float()
    scores = reward.total
    record = {
        "step": step,
        "policy_version": actor.model_version,
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item() if scores.numel() > 1 else 0.0,
        # Each source's raw score (before its weight; failed samples left out), and how many
        # samples a source failed on (they got reward.fallback_score for it).
        **{f"reward/{name}/mean": mean for name, mean in reward.source_means().items()},
        "reward/errors": reward.failed,
        "kl": targets.kl[own].mean().item(),
        "entropy": logprobs.entropy[own].mean().item(),
        **_stats("response_length", lengths),
        "response_length/clip_ratio": sum(s.finish_reason == FinishReason.LENGTH for s in samples) / len(samples),
        **_stats("advantage", targets.advantages),
        **_stats("return", targets.returns),
        # Same weights, two engines: the gap shows sampling/numerics drift between rollout and training.
        "rollout_train_logprob_diff/mean": mismatch_mean.item(),
        "rollout_train_logprob_diff/max": mismatch_max.item(),
        **{f"actor/{k}": v for k, v in actor.stats.items()},
    }
    if critic is not None:
        record.update({f"critic/{k}": v for k, v in critic.stats.items()})
        record.update(_stats("value", values))
        record["critic/vf_explained_var"] = explained_variance(values, targets.returns)
    trainers = [actor.stats] + ([critic.stats] if critic is not None else [])
    # torch.compile in the trainers this step (they update side by side: the longest compile counts).
    record["compile/graphs"] = sum(s.get("compiled_graphs", 0) for s in trainers)
    record["compile/seconds"] = max(s.get("compile_seconds", 0.0) for s in trainers)
    record.update({f"timing/{phase}_s": s for phase, s in seconds.items()})
    record["throughput/tokens_per_s"] = batch.num_response_tokens / seconds["step"]
    return record

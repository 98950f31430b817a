"""Evaluation during training (`eval.*`, docs/config.md): held-out prompts through the actor's own
rollout engine and the run's reward sources, between updates.

An evaluation is a Generate and a Score, nothing else: no logprobs recomputed, no update, so no
weight, policy version or step ledger changes, and its samples never reach the journal. The
samples say which policy version made them (`eval/policy_version`). In async mode an evaluation
runs in the train stage after an update, while later batches may be generating: its samples are
never trained on, so the staleness bound does not apply to them, and the bound of the batches
around it is unchanged (generation only waits a little longer for the actor's rollout lock).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from rolefleet.actor.types import FinishReason, Sample, SamplingParams
from rolefleet.algos import pass_at_k
from rolefleet.common.config import RoleFleetConfig
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.episodes import episode_metrics, with_env_rewards
from rolefleet.reward.types import ScoreItem, ScoreResult
from rolefleet.tasks import PromptRecord

log = logging.getLogger(__name__)
EVAL_SEED = 99_991  # one seed for every evaluation of a run: sampled evaluations compare the same draws
SAMPLES_FILE = "eval_samples.jsonl"

Call = Callable[..., Awaitable[Any]]


class Evaluator:
    """The run's held-out prompts and when to evaluate them; `run` makes one evaluation."""

    def __init__(self, cfg: RoleFleetConfig, train_prompts: set[str]):
        self.cfg, e = cfg, cfg.eval
        self.records: list[PromptRecord] = PromptDataset.for_eval(cfg).records
        # Prompts also trained on make a held-out figure optimistic: said once, and in every record.
        self.overlap = sum(r.prompt in train_prompts for r in self.records)
        if self.overlap:
            log.warning("eval: %d of the %d held-out prompts also appear in the training data: eval/* is not "
                        "held out for them", self.overlap, len(self.records))
        self.sampling = SamplingParams(
            temperature=e.temperature, max_new_tokens=e.max_new_tokens or cfg.sampling.max_new_tokens,
            n=e.samples_per_prompt, seed=cfg.eval_seed * 100_003 + EVAL_SEED,
            stop_token_ids=tuple(cfg.sampling.stop_token_ids))

    @classmethod
    def for_run(cls, cfg: RoleFleetConfig, train: PromptDataset) -> Evaluator | None:
        return cls(cfg, {r.prompt for r in train.records}) if cfg.eval.enabled else None

    async def before_training(self, logger, status, generate: Call, score: Call) -> None:
        """The starting policy's evaluation as the record of step 0 (`eval.before_train`); none when
        the run's records hold one already (resumed, or recovered to the checkpoint of step 0)."""
        if not self.due(0) or any(r["step"] == 0 for r in logger.records):
            return
        record = await self.run(0, generate, score)
        record = {"step": 0, "policy_version": int(record["eval/policy_version"]), **record}
        logger.log_eval(record)
        status.record_eval(record)

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` (0: before the first)."""
        e, total = self.cfg.eval, self.cfg.train.total_steps
        if not e.enabled:
            return False
        if step == 0:
            return e.before_train
        return step % e.every == 0 or (e.at_end and step == total)

    async def run(self, step: int, generate: Call, score: Call) -> dict[str, float]:
        """One evaluation after `step` through `generate` (ActorClient.generate, or a retrying
        wrapper) and `score` (RewardClient.score): the eval/* entries of the step's record. With
        `eval.save_samples`, each sample goes to <output_dir>/eval_samples.jsonl."""
        start = time.perf_counter()
        prompts = [r.prompt for r in self.records]
        samples: list[Sample] = await generate(prompts, self.sampling, 0)
        result: ScoreResult = await score([ScoreItem(self.records[s.prompt_index].prompt, s.response_text,
                                                     self.records[s.prompt_index].ground_truth,
                                                     self.records[s.prompt_index].extra) for s in samples])
        result = with_env_rewards(result, samples)  # what an environment or agent rewarded
        record = eval_record(samples, result, len(self.records), self.sampling.n, self.cfg.eval.pass_threshold)
        record["eval/train_overlap"] = float(self.overlap)
        record["eval/time_s"] = time.perf_counter() - start
        if self.cfg.eval.save_samples:
            self._save(step, samples, result)
        return record

    def _save(self, step: int, samples: list[Sample], result: ScoreResult) -> None:
        """What the model answered, for reading (a resumed run appends its evaluations again)."""
        path = self.cfg.run.out / SAMPLES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for s, reward, error in zip(samples, result.total.tolist(), result.errors):
                r = self.records[s.prompt_index]
                f.write(json.dumps({
                    "step": step, "policy_version": s.policy_version, "prompt_index": s.prompt_index,
                    "sample_index": s.sample_index, "prompt": r.prompt, "response": s.response_text,
                    "ground_truth": r.ground_truth, "reward": reward, "reward_error": error,
                    "finish_reason": s.finish_reason.name.lower(), "response_tokens": len(s.response_ids),
                    "last_token_id": int(s.response_ids[-1]) if len(s.response_ids) else None,
                }, ensure_ascii=False) + "\n")


def eval_record(samples: list[Sample], result: ScoreResult, prompts: int, n: int,
                pass_threshold: float) -> dict[str, float]:
    """The metrics of one evaluation (keys in docs/metrics.md, "Evaluation")."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].prompt_index, samples[i].sample_index))
    total = result.total[order]
    correct = (total >= pass_threshold).view(prompts, n)
    lengths = torch.tensor([len(samples[i].response_ids) for i in order], dtype=torch.float32)
    record = {
        "eval/reward/mean": total.mean().item(),
        **{f"eval/{name}/mean": mean for name, mean in result.source_means().items()},  # means: order-free
        "eval/pass@1": pass_at_k(correct, 1).item(),
        "eval/response_length/mean": lengths.mean().item(),
        "eval/clip_ratio": sum(s.finish_reason == FinishReason.LENGTH for s in samples) / len(samples),
        "eval/errors": float(result.failed),
        "eval/prompts": float(prompts),
        "eval/policy_version": float(min(s.policy_version for s in samples)),
    }
    if n > 1:
        record[f"eval/pass@{n}"] = pass_at_k(correct, n).item()
    if any(s.episode is not None for s in samples):  # multi-turn: how the conversations went
        record.update(episode_metrics(samples, prefix="eval/episode"))
    return record

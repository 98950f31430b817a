"""A generated rollout batch, what the step body trains on, and the pure pieces both modes use to
make one (its prompts, sampling seed and group ids are functions of its batch number)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rolefleet.actor.types import LogProbs, Sample, SamplingParams
from rolefleet.common import metrics
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.errors import FailedPrecondition
from rolefleet.critic.types import CriticValues
from rolefleet.reward.types import ScoreItem, ScoreResult
from rolefleet.tasks import PromptRecord


@dataclass
class Rollout:
    """One rollout batch. What the generate stage already has of its scores, values and logprobs
    (async mode streams its chunks to the reward and the critic) the step body does not ask for
    again; the rest it asks for at once (`StepBody.run`, step 2)."""

    index: int  # 1-based rollout batch number (its data batch, seed and group ids)
    records: list[PromptRecord]
    samples: list[Sample]
    batch: SequenceBatch
    generate_s: float  # seconds from the request to the batch's last sample
    scoring: list[asyncio.Future] = field(default_factory=list)  # async: reward + critic calls per chunk, in order
    reward: ScoreResult | None = None
    values: CriticValues | None = None  # None with no critic, or not asked for yet
    logprobs: LogProbs | None = None  # async one-pass update: the reference's, asked for with the scores
    score_s: float = 0.0  # seconds waited for the scores after the last sample (async: the score stage's)
    env_s: float = 0.0  # multi-turn: seconds of its generation spent waiting for the environment
    stats: dict[str, float] = field(default_factory=dict)  # the record's entries of how it was made (`dynamic/*`)

    @property
    def oldest_version(self) -> int:
        return min(s.policy_version for s in self.samples)


def spent(phase: str, since: float) -> float:
    """Seconds since `since`, also counted as the coordinator's time in `phase`
    (`rolefleet_stage_busy_seconds`: sync mode its phases, async mode its stages)."""
    seconds = time.perf_counter() - since
    metrics.STAGE_SECONDS.labels("coordinator", phase).inc(seconds)
    return seconds


def to_batch(samples: list[Sample]) -> SequenceBatch:
    """The samples as a packed batch; multi-turn samples bring their loss masks."""
    masks = [s.loss_mask for s in samples]
    return SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                    masks if any(m is not None for m in masks) else None)


def score_items(records: list[PromptRecord], samples: list[Sample]) -> list[ScoreItem]:
    return [ScoreItem(records[s.prompt_index].prompt, s.response_text, records[s.prompt_index].ground_truth,
                      records[s.prompt_index].extra) for s in samples]


def policy_version_of(samples: list[Sample]) -> int:
    versions = {s.policy_version for s in samples}
    if len(versions) != 1:
        # Sync mode generates a step with one policy; mixed versions mean the actor changed mid-step.
        raise FailedPrecondition(f"one step's samples came from several policy versions: {sorted(versions)}")
    return versions.pop()


def first_group_id(cfg: RoleFleetConfig, batch_index: int) -> int:
    """Group ids run on across the run's rollout batches (1-based), one per prompt."""
    return (batch_index - 1) * cfg.train.prompts_per_step


def sampling_for(cfg: RoleFleetConfig, batch_index: int) -> SamplingParams:
    s = cfg.sampling
    # A per-batch seed: a rerun of the same config samples the same rollouts.
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          n=cfg.train.samples_per_prompt, seed=cfg.run.seed * 100_003 + batch_index,
                          stop_token_ids=tuple(s.stop_token_ids))

"""Domain types of the actor role (what the core takes and returns; the gRPC shell converts)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

import torch

from rolefleet.common.config import MIN_TEMPERATURE, MIN_WIRE_TEMPERATURE
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.role_types import UpdateResult
from rolefleet.common.top_k import TopK


class FinishReason(IntEnum):  # values match rolefleet.v1.FinishReason
    STOP = 1    # ended at a stop token (the response's last token; common/stop_tokens.py)
    LENGTH = 2  # reached max_new_tokens


MAX_STOP_TOKENS = 256  # stop ids one request may add to the checkpoint's


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0       # 0: greedy (evaluation); training samples at >= MIN_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    n: int = 1
    seed: int = -1
    stop_token_ids: tuple[int, ...] = ()  # ids that end a response besides the checkpoint's own
    stop_at_end_of_turn: bool = False     # also the chat template's end-of-turn token (multi-turn rollouts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, field_prefix: str = "sampling") -> None:
        checks = [
            ("temperature", self.greedy or (math.isfinite(self.temperature) and self.temperature >= MIN_WIRE_TEMPERATURE),
             f"must be 0 (greedy), or finite and >= {MIN_TEMPERATURE}"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),  # NaN fails the comparison too
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("max_new_tokens", self.max_new_tokens > 0, "must be > 0"),
            ("n", 0 < self.n < SAMPLES_PER_GROUP_LIMIT, f"must be in [1, {SAMPLES_PER_GROUP_LIMIT})"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidArgument(f"{field_prefix}.{name}", f"{rule}, got {getattr(self, name)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKENS:
            raise InvalidArgument(f"{field_prefix}.stop_token_ids", f"{len(self.stop_token_ids)} ids, at most "
                                  f"{MAX_STOP_TOKENS}")
        for i, token in enumerate(self.stop_token_ids):
            if token < 0:
                raise InvalidArgument(f"{field_prefix}.stop_token_ids[{i}]", f"must be >= 0, got {token}")


@dataclass(frozen=True)
class Sample:
    prompt_index: int
    sample_index: int
    prompt_ids: torch.Tensor       # int64 [P]
    response_ids: torch.Tensor     # int64 [R]
    logprobs: torch.Tensor         # float32 [R], rollout engine
    finish_reason: FinishReason
    policy_version: int
    response_text: str
    group_id: int = 0              # the run's id of the prompt's group (GenerateRequest.first_group_id + prompt_index)
    sample_id: int = 0             # group_id * SAMPLES_PER_GROUP_LIMIT + sample_index: unique in the run
    # Multi-turn samples (assembled by the coordinator, `coordinator/episodes.py`): bool [R], True on
    # the model's tokens, False on the observations between its turns; None: all the model's.
    loss_mask: torch.Tensor | None = None
    episode: EpisodeStats | None = None  # multi-turn samples: what the conversation did
    # The rollout source's episodes (`coordinator/episodes.py`): int64 [R], the policy version that generated each
    # token (policy_version is the oldest); None: all of them policy_version's.
    token_versions: torch.Tensor | None = None


@dataclass(frozen=True)
class EpisodeStats:
    """What one multi-turn conversation did (the step's `episode/*` metrics, docs/metrics.md)."""

    turns: int = 1            # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0      # malformed calls, unknown tools, failed tools (timeouts included)
    tool_timeouts: int = 0
    env_error: str = ""       # the environment failed on the conversation (it ended there)
    env_reward: float | None = None  # sum of the environment's rewards, added to the sample's score
    observation_tokens: int = 0


@dataclass(frozen=True)
class Continuation:
    """A conversation to continue by one assistant turn (multi-turn rollouts, `actor/turns.py`): its
    tokens so far exactly as generated, and the environment's answer to render and append. Or, with
    `resume_from` > 0 and no observation, a response cut at a token budget to generate on
    (partial rollouts, `coordinator/source.py`): it began at `context_ids[resume_from]`."""

    context_ids: torch.Tensor           # int64 [C]
    observation: list[dict[str, str]]   # {role, content} messages, at least one unless resuming
    resume_from: int = 0


SAMPLES_PER_GROUP_LIMIT = 1 << 20  # n per prompt stays below it, so sample ids of distinct groups never meet


def with_ids(samples: list[Sample], first_group_id: int) -> list[Sample]:
    """The samples stamped with their group and sample ids."""
    return [replace(s, group_id=(g := first_group_id + s.prompt_index),
                    sample_id=g * SAMPLES_PER_GROUP_LIMIT + s.sample_index) for s in samples]


@dataclass(frozen=True)
class LogProbs:
    logprobs: torch.Tensor | None          # float32 [N]; None: the reference's alone were asked for
    ref_logprobs: torch.Tensor | None      # float32 [N]
    entropy: torch.Tensor | None           # float32 [N], with `logprobs`
    policy_version: int


@dataclass(frozen=True)
class PolicyTargets:
    """Per-token inputs of one policy update, packed [N] like the batch's responses."""

    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None               # recomputed by the training engine; None: a one-pass
                                                    # update takes them from its own forward
    ref_logprobs: torch.Tensor | None = None        # for the KL loss term
    rollout_logprobs: torch.Tensor | None = None    # for importance-sampling correction
    teacher_top: TopK | None = None                 # the teacher's most likely tokens, for its KL loss term


@dataclass(frozen=True)
class ActorUpdateResult(UpdateResult):
    """An actor's Update answer. A one-pass update (no old logprobs sent) also returns the logprobs
    and entropy of its own forward, before its optimizer step: the old policy's, for the step's
    metrics. A replay of the newest step returns them too; of an older one, not."""

    logprobs: LogProbs | None = None


@dataclass(frozen=True)
class Trajectory:
    """What a closed session trains as (no turns: the agent never asked for a completion)."""

    session_id: str
    prompt_ids: torch.Tensor            # int64 [P]
    response_ids: torch.Tensor          # int64 [R]
    logprobs: torch.Tensor              # float32 [R] (0 on rendered messages)
    versions: torch.Tensor              # int64 [R]
    own: torch.Tensor                   # bool [R]: the model's tokens
    finish_reason: FinishReason
    turns: int
    last_text: str                      # the text of its last completion
    error: str = ""                     # why there is nothing to train ("" when there is)
    tool_calls: int = 0                 # function calls its completions made


@dataclass(frozen=True)
class AgentTask:
    """An episode's task for an agent outside the cluster that claims it (`reward.agent.external`)."""

    prompt: Any                         # as the dataset gave it: text, or chat messages
    ground_truth: str
    extra: dict = field(default_factory=dict)


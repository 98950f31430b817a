"""Actor domain types <-> rolefleet.v1 messages, shared by the servicer and the gRPC client."""

from __future__ import annotations

import torch

from rolefleet.actor.types import FinishReason, LogProbs, PolicyTargets, Sample, SamplingParams
from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.pb import actor_pb2, common_pb2
from rolefleet.common.roles import UpdateResult


def sampling_to_proto(s: SamplingParams) -> actor_pb2.SamplingParams:
    return actor_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_new_tokens=s.max_new_tokens, n=s.n, seed=s.seed)


def sampling_from_proto(m: actor_pb2.SamplingParams) -> SamplingParams:
    params = SamplingParams(temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
                            max_new_tokens=m.max_new_tokens, n=m.n, seed=m.seed)
    params.validate("sampling")
    return params


def sample_to_proto(s: Sample) -> actor_pb2.GenerateResponse:
    return actor_pb2.GenerateResponse(
        prompt_index=s.prompt_index, sample_index=s.sample_index,
        prompt_ids=codec.encode(s.prompt_ids), response_ids=codec.encode(s.response_ids),
        logprobs=codec.encode(s.logprobs), finish_reason=int(s.finish_reason),
        policy_version=s.policy_version, response_text=s.response_text, group_id=s.group_id, sample_id=s.sample_id,
    )


def sample_from_proto(m: actor_pb2.GenerateResponse) -> Sample:
    return Sample(
        prompt_index=m.prompt_index, sample_index=m.sample_index,
        prompt_ids=codec.decode_as(m.prompt_ids, "prompt_ids", torch.int64, 1),
        response_ids=codec.decode_as(m.response_ids, "response_ids", torch.int64, 1),
        logprobs=codec.decode_as(m.logprobs, "logprobs", torch.float32, 1),
        finish_reason=FinishReason(m.finish_reason), policy_version=m.policy_version,
        response_text=m.response_text, group_id=m.group_id, sample_id=m.sample_id,
    )


def logprobs_to_proto(lp: LogProbs) -> actor_pb2.ComputeLogProbsResponse:
    return actor_pb2.ComputeLogProbsResponse(
        logprobs=codec.encode(lp.logprobs),
        ref_logprobs=codec.encode(lp.ref_logprobs) if lp.ref_logprobs is not None else None,
        entropy=codec.encode(lp.entropy),
        policy_version=lp.policy_version,
    )


def logprobs_from_proto(m: actor_pb2.ComputeLogProbsResponse) -> LogProbs:
    return LogProbs(
        logprobs=codec.decode_as(m.logprobs, "logprobs", torch.float32, 1),
        ref_logprobs=codec.decode_as(m.ref_logprobs, "ref_logprobs", torch.float32, 1)
        if m.HasField("ref_logprobs") else None,
        entropy=codec.decode_as(m.entropy, "entropy", torch.float32, 1),
        policy_version=m.policy_version,
    )


def stats_to_proto(stats: dict[str, float]) -> common_pb2.TrainStats:
    return common_pb2.TrainStats(values=stats)


def update_result_to_proto(r: UpdateResult) -> actor_pb2.ActorUpdateResponse:
    return actor_pb2.ActorUpdateResponse(step=r.step, policy_version=r.model_version,
                                         stats=stats_to_proto(r.stats))


def update_result_from_proto(m: actor_pb2.ActorUpdateResponse) -> UpdateResult:
    return UpdateResult(step=m.step, model_version=m.policy_version, stats=dict(m.stats.values))


def policy_targets_to_proto(t: PolicyTargets) -> dict:
    """The per-token fields of an ActorUpdateRequest; absent optional tensors stay unset."""
    fields = {"advantages": codec.encode(t.advantages), "old_logprobs": codec.encode(t.old_logprobs)}
    for name in ("ref_logprobs", "rollout_logprobs"):
        if getattr(t, name) is not None:
            fields[name] = codec.encode(getattr(t, name))
    return fields


def policy_targets_from_proto(m: actor_pb2.ActorUpdateRequest, batch: SequenceBatch) -> PolicyTargets:
    def optional(name: str):
        return batch.per_token(getattr(m, name), name) if m.HasField(name) else None

    return PolicyTargets(
        advantages=batch.per_token(m.advantages, "advantages"),
        old_logprobs=batch.per_token(m.old_logprobs, "old_logprobs"),
        ref_logprobs=optional("ref_logprobs"),
        rollout_logprobs=optional("rollout_logprobs"),
    )

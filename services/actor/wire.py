"""Actor domain types <-> rolefleet.v1 messages, shared by the servicer and the gRPC client."""

from __future__ import annotations

import json

import torch

from rolefleet.actor.types import (
    ActorUpdateResult,
    AgentTask,
    Continuation,
    FinishReason,
    LogProbs,
    PolicyTargets,
    Sample,
    SamplingParams,
    Trajectory,
)
from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.pb import actor_pb2, common_pb2
from rolefleet.common.top_k import TEACHER_TOP_FIELDS, TopK


def sampling_to_proto(s: SamplingParams) -> actor_pb2.SamplingParams:
    return actor_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_new_tokens=s.max_new_tokens, n=s.n, seed=s.seed,
                                    stop_token_ids=list(s.stop_token_ids), stop_at_end_of_turn=s.stop_at_end_of_turn)


def sampling_from_proto(m: actor_pb2.SamplingParams) -> SamplingParams:
    params = SamplingParams(temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
                            max_new_tokens=m.max_new_tokens, n=m.n, seed=m.seed,
                            stop_token_ids=tuple(m.stop_token_ids), stop_at_end_of_turn=m.stop_at_end_of_turn)
    params.validate("sampling")
    return params


def continuation_to_proto(c: Continuation) -> actor_pb2.Continuation:
    return actor_pb2.Continuation(context_ids=codec.encode(c.context_ids), observation=[
        common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in c.observation], resume_from=c.resume_from)


def continuations_from_proto(messages) -> list[Continuation]:
    return [Continuation(codec.decode_as(m.context_ids, f"continuations[{i}].context_ids", torch.int64, 1),
                         [{"role": o.role, "content": o.content} for o in m.observation], m.resume_from)
            for i, m in enumerate(messages)]


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
    return actor_pb2.ComputeLogProbsResponse(**_per_token(lp), policy_version=lp.policy_version)


def logprobs_from_proto(m: actor_pb2.ComputeLogProbsResponse) -> LogProbs:
    return LogProbs(**_per_token_from(m, ("logprobs", "ref_logprobs", "entropy")), policy_version=m.policy_version)


def _per_token(lp: LogProbs) -> dict:
    """A LogProbs' tensors as message fields; absent ones stay unset."""
    return {name: codec.encode(getattr(lp, name)) for name in ("logprobs", "ref_logprobs", "entropy")
            if getattr(lp, name) is not None}


def _per_token_from(m, names: tuple[str, ...]) -> dict:
    return {name: codec.decode_as(getattr(m, name), name, torch.float32, 1) if m.HasField(name) else None
            for name in names}


def stats_to_proto(stats: dict[str, float]) -> common_pb2.TrainStats:
    return common_pb2.TrainStats(values=stats)


def update_result_to_proto(r: ActorUpdateResult) -> actor_pb2.ActorUpdateResponse:
    return actor_pb2.ActorUpdateResponse(step=r.step, policy_version=r.model_version, stats=stats_to_proto(r.stats),
                                         **(_per_token(r.logprobs) if r.logprobs is not None else {}))


def update_result_from_proto(m: actor_pb2.ActorUpdateResponse) -> ActorUpdateResult:
    one_pass = _per_token_from(m, ("logprobs", "entropy"))
    logprobs = (LogProbs(**one_pass, ref_logprobs=None, policy_version=m.policy_version - 1)
                if one_pass["logprobs"] is not None else None)
    return ActorUpdateResult(step=m.step, model_version=m.policy_version, stats=dict(m.stats.values),
                             logprobs=logprobs)


def policy_targets_to_proto(t: PolicyTargets) -> dict:
    """The per-token fields of an ActorUpdateRequest; absent optional tensors stay unset."""
    fields = {"advantages": codec.encode(t.advantages)}
    for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        if getattr(t, name) is not None:
            fields[name] = codec.encode(getattr(t, name))
    if t.teacher_top is not None:
        fields["teacher_top_ids"], fields["teacher_top_logprobs"] = t.teacher_top.to_proto()
    return fields


def policy_targets_from_proto(m: actor_pb2.ActorUpdateRequest, batch: SequenceBatch) -> PolicyTargets:
    def optional(name: str):
        return batch.per_token(getattr(m, name), name) if m.HasField(name) else None

    top = None
    if m.HasField("teacher_top_ids") or m.HasField("teacher_top_logprobs"):
        top = TopK.from_proto(m.teacher_top_ids, m.teacher_top_logprobs, batch, TEACHER_TOP_FIELDS)
    return PolicyTargets(
        advantages=batch.per_token(m.advantages, "advantages"),
        old_logprobs=optional("old_logprobs"),
        ref_logprobs=optional("ref_logprobs"),
        rollout_logprobs=optional("rollout_logprobs"),
        teacher_top=top,
    )


def trajectory_to_proto(t: Trajectory) -> actor_pb2.Trajectory:
    return actor_pb2.Trajectory(
        session_id=t.session_id, prompt_ids=codec.encode(t.prompt_ids), response_ids=codec.encode(t.response_ids),
        logprobs=codec.encode(t.logprobs), versions=codec.encode(t.versions), own=codec.encode(t.own),
        finish_reason=int(t.finish_reason), turns=t.turns, last_text=t.last_text, error=t.error,
        tool_calls=t.tool_calls)


def trajectory_from_proto(m: actor_pb2.Trajectory) -> Trajectory:
    field = f"trajectories[{m.session_id}]"
    return Trajectory(
        m.session_id, codec.decode_as(m.prompt_ids, f"{field}.prompt_ids", torch.int64, 1),
        codec.decode_as(m.response_ids, f"{field}.response_ids", torch.int64, 1),
        codec.decode_as(m.logprobs, f"{field}.logprobs", torch.float32, 1),
        codec.decode_as(m.versions, f"{field}.versions", torch.int64, 1),
        codec.decode_as(m.own, f"{field}.own", torch.bool, 1),
        FinishReason(m.finish_reason) if m.finish_reason else FinishReason.LENGTH, m.turns, m.last_text, m.error,
        m.tool_calls)


def task_to_proto(t: AgentTask) -> actor_pb2.AgentTask:
    return actor_pb2.AgentTask(prompt_json=json.dumps(t.prompt), ground_truth=t.ground_truth,
                               extra_json=json.dumps(t.extra) if t.extra else "")


def tasks_from_proto(messages) -> list[AgentTask]:
    tasks = []
    for i, m in enumerate(messages):
        try:
            prompt, extra = json.loads(m.prompt_json), json.loads(m.extra_json) if m.extra_json else {}
        except (ValueError, RecursionError):
            raise InvalidArgument(f"tasks[{i}]", "prompt_json and extra_json must be JSON") from None
        if not isinstance(extra, dict):
            raise InvalidArgument(f"tasks[{i}].extra_json", "must be a JSON object")
        tasks.append(AgentTask(prompt, m.ground_truth, extra))
    return tasks


"""Property-based fuzzing of every RPC of every role server (actor, critic, reward, coordinator).

Each role serves once per module on a loopback port, from an event loop on a thread of its own, and
hypothesis drives a synchronous client at it. A malformed request must be answered at once with a
refusal (a status in fuzzing.REFUSALS, with details that name the field at fault where one is), must leave
the role as it was (GetStatus with the weights digest: model version, last step, digest, not
broken), and a valid request must still be served afterwards. Strategies start from a valid request
and break one to three of its parts, so nearly every example is malformed; one that happens to be
valid may be applied, and the known state then moves with it. The checkpoint requests fuzzing once
found crashing or destroying (a file in the way, a directory without weights, the checkpoint root
as a save target) are kept as plain cases at the end.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from rolefleet.actor import server as actor_server
from rolefleet.actor.core import ActorCore
from rolefleet.common import codec
from rolefleet.common.config import RewardSection, parse_config
from rolefleet.common.pb import (
    actor_pb2,
    actor_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    critic_pb2,
    critic_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
)
from rolefleet.coordinator import server as coordinator_server
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.critic import server as critic_server
from rolefleet.critic.core import CriticCore
from rolefleet.reward import server as reward_server
from rolefleet.reward.core import RewardCore
from tests.security.fuzzing import (
    CALL_TIMEOUT_S,
    FUZZ,
    GOOD_BATCH,
    INT32,
    INT64,
    TRAINER_LIMITS,
    UNDECODABLE,
    Code,
    Method,
    Outcome,
    Relative,
    ServedRole,
    Trainer,
    bad_batches,
    bad_floats,
    bad_per_token,
    bad_steps,
    bad_versions,
    broken_parts,
    call,
    check_refused,
    checkpoint_paths,
    decodes,
    garbage,
    garbled,
    trainer_methods,
    weird_text,
)

MAX_PROMPT_BYTES = 512
MAX_ITEMS, MAX_ITEM_BYTES = 8, 4096


def served_trainer(role, core, server_module, stub_class, tmp_path_factory, update):
    """A fixture's body: `core` served over gRPC for the module's tests, closed after them."""
    served = ServedRole(role, lambda server: server_module.add_to_server(core, server))
    try:
        yield Trainer(role, core, served, stub_class(served.channel), tmp_path_factory.mktemp(f"{role}-fuzz"), update)
    finally:
        served.close()
        core.close()


# --- the actor ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def actor(tiny_model_dir, tmp_path_factory):
    overrides = ["actor.compute_dtype=float32", f"actor.max_prompt_bytes={MAX_PROMPT_BYTES}",
                 *(f"actor.{limit}" for limit in TRAINER_LIMITS)]
    core = ActorCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}}, overrides).actor)
    yield from served_trainer("actor", core, actor_server, actor_pb2_grpc.ActorServiceStub, tmp_path_factory,
                              actor_update)


def actor_update(trainer: Trainer, **changes) -> actor_pb2.ActorUpdateRequest:
    fields = dict(step=trainer.last_step + 1, policy_version=trainer.version, batch=GOOD_BATCH.to_proto(),
                  temperature=1.0, advantages=codec.encode(torch.ones(2)), old_logprobs=codec.encode(torch.zeros(2)))
    return actor_pb2.ActorUpdateRequest(**{**fields, **trainer.resolve(changes)})


SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=2, n=1, seed=7)
GENERATE_PARTS = {
    "prompts": st.one_of(st.just([]), st.lists(weird_text, min_size=1, max_size=4),
                         st.integers(17, 40).map(lambda k: ["1+1="] * k),  # past 16 sequences
                         st.sampled_from([["\u00e9" * (MAX_PROMPT_BYTES // 2 + 1)], ["1" * 200], ["", "1+1="]])),
    "temperature": bad_floats,
    "top_p": st.one_of(st.sampled_from([0.0, -0.5, 1.0000001, 2.0, math.nan, math.inf, -math.inf]), st.floats(width=32)),
    "top_k": INT32,
    "max_new_tokens": st.one_of(st.integers(-2**31, 0), st.integers(100, 2**31 - 1)),
    "n": st.one_of(st.integers(-2**31, 0), st.integers(17, 2**31 - 1)),
    "seed": INT64,
    "first_group_id": st.one_of(st.integers(-2**63, -1), st.integers(2**43 - 1, 2**63 - 1)),
    "sampling": st.none(),  # unset: every field 0
}


def generate_request(changes: dict[str, Any]) -> actor_pb2.GenerateRequest:
    sampling = {**SAMPLING, **{k: v for k, v in changes.items() if k in SAMPLING}}
    return actor_pb2.GenerateRequest(
        prompts=changes.get("prompts", ["1+1="]), first_group_id=changes.get("first_group_id", 0),
        sampling=None if "sampling" in changes else actor_pb2.SamplingParams(**sampling))


def test_actor_generate(actor):
    @FUZZ
    @given(broken_parts(GENERATE_PARTS))
    @example({"first_group_id": 2**62})  # sample ids past int64 used to fail the stream with INTERNAL
    def fuzz(changes):
        request = generate_request(changes)
        outcome = call(actor.stub.Generate, request, streaming=True)
        actor.check(outcome, actor_pb2.GenerateRequest, "Generate")
        if outcome.ok:
            assert len(outcome.replies) == len(request.prompts) * request.sampling.n

    fuzz()
    assert len(call(actor.stub.Generate, generate_request({}), streaming=True).replies) == 1


def test_actor_compute_logprobs(actor):
    parts = {"batch": bad_batches, "temperature": bad_floats, "include_reference": st.booleans()}

    @FUZZ
    @given(broken_parts(parts))
    def fuzz(changes):
        request = actor_pb2.ComputeLogProbsRequest(**{"batch": GOOD_BATCH.to_proto(), "temperature": 1.0, **changes})
        actor.check(call(actor.stub.ComputeLogProbs, request), actor_pb2.ComputeLogProbsRequest, "ComputeLogProbs")

    fuzz()
    actor.assert_still_serves()


def test_actor_update(actor):
    parts = {"step": bad_steps, "policy_version": bad_versions, "batch": bad_batches, "advantages": bad_per_token,
             "old_logprobs": bad_per_token, "ref_logprobs": bad_per_token, "rollout_logprobs": bad_per_token,
             "temperature": bad_floats}

    @settings(FUZZ, max_examples=60)
    @given(broken_parts(parts))
    def fuzz(changes):
        outcome = call(actor.stub.Update, actor_update(actor, **changes))
        actor.check(outcome, actor_pb2.ActorUpdateRequest, "Update", mutates=True)

    fuzz()
    actor.assert_still_serves()


def under(root: Path, path: str) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def fuzz_checkpoints(trainer: Trainer) -> None:
    @settings(FUZZ, max_examples=30)
    @given(st.one_of(st.just(Relative("last_step", 0)), bad_steps), checkpoint_paths(trainer))
    def save(step, path):
        request = common_pb2.SaveCheckpointRequest(step=trainer.resolve({"step": step})["step"], path=path)
        outcome = call(trainer.stub.SaveCheckpoint, request)
        trainer.check(outcome, common_pb2.SaveCheckpointRequest, "SaveCheckpoint")
        if outcome.ok:  # only the last applied step, only under the root
            assert request.step == trainer.last_step and under(trainer.root, path) and (Path(path) / "role.json").is_file()

    @settings(FUZZ, max_examples=30)
    @given(st.one_of(checkpoint_paths(trainer), st.none()))
    def load(path):
        path = trainer.saved() if path is None else path
        outcome = call(trainer.stub.LoadCheckpoint, common_pb2.LoadCheckpointRequest(path=path))
        trainer.check(outcome, common_pb2.LoadCheckpointRequest, "LoadCheckpoint", mutates=True)
        assert not outcome.ok or under(trainer.root, path)

    save()
    load()
    trainer.assert_still_serves()
    last = common_pb2.SaveCheckpointRequest(step=trainer.last_step, path=str(trainer.root / "last"))
    assert call(trainer.stub.SaveCheckpoint, last).ok and (trainer.root / "last" / "role.json").is_file()
    # Nothing was written outside the root, and no save was left half done.
    assert [p.name for p in trainer.root.parent.iterdir()] == ["checkpoints"]
    assert not list(trainer.root.glob("**/*.partial"))


def test_actor_checkpoints(actor):
    fuzz_checkpoints(actor)


# --- the critic -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def critic(tiny_model_dir, tmp_path_factory):
    overrides = ["critic.compute_dtype=float32", *(f"critic.{limit}" for limit in TRAINER_LIMITS)]
    core = CriticCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}}, overrides).critic)
    yield from served_trainer("critic", core, critic_server, critic_pb2_grpc.CriticServiceStub, tmp_path_factory,
                              critic_update)


def critic_update(trainer: Trainer, **changes) -> critic_pb2.CriticUpdateRequest:
    fields = dict(step=trainer.last_step + 1, batch=GOOD_BATCH.to_proto(), returns=codec.encode(torch.ones(2)),
                  old_values=codec.encode(torch.zeros(2)), values_version=trainer.version)
    return critic_pb2.CriticUpdateRequest(**{**fields, **trainer.resolve(changes)})


def test_critic_compute_values(critic):
    @FUZZ
    @given(bad_batches)
    def fuzz(batch):
        outcome = call(critic.stub.ComputeValues, critic_pb2.ComputeValuesRequest(batch=batch))
        critic.check(outcome, critic_pb2.ComputeValuesRequest, "ComputeValues")

    fuzz()
    critic.assert_still_serves()


def test_critic_update(critic):
    parts = {"step": bad_steps, "batch": bad_batches, "returns": bad_per_token, "old_values": bad_per_token,
             "values_version": bad_versions}

    @settings(FUZZ, max_examples=60)
    @given(broken_parts(parts))
    def fuzz(changes):
        outcome = call(critic.stub.Update, critic_update(critic, **changes))
        critic.check(outcome, critic_pb2.CriticUpdateRequest, "Update", mutates=True)

    fuzz()
    critic.assert_still_serves()


def test_critic_checkpoints(critic):
    fuzz_checkpoints(critic)


# --- the reward role ------------------------------------------------------------------------------

REWARD_SOURCES = [{"function": "exact_match"}, {"function": "numeric_match"}, {"function": "regex", "pattern": "[0-9]"},
                  {"function": "format", "pattern": "<a>.*</a>"}, {"function": "length_penalty", "target": 8},
                  {"function": "math"}]
REFERENCE = reward_pb2.ScoreRequest(items=[
    reward_pb2.ScoreItem(prompt="1+1=", response="2", ground_truth="2"),
    reward_pb2.ScoreItem(prompt="q", response="\\boxed{\\frac{1}{2}}", ground_truth="#### 0.5"),
    reward_pb2.ScoreItem(prompt="p", response="<a>7</a> and more", ground_truth="7", extra_json='{"k": [1, {"a": null}]}'),
])


ENV_REFERENCE = reward_pb2.EnvStepRequest(items=[reward_pb2.EnvStepItem(
    prompt="p", ground_truth="42", messages=[common_pb2.ChatMessage(
        role="assistant", content='<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')])])


class Scorer:
    """The reward role under fuzzing: stateless, so each refusal is followed by the reference request,
    which must score exactly as it did at the start."""

    def __init__(self, served: ServedRole):
        self.served, self.stub = served, reward_pb2_grpc.RewardServiceStub(served.channel)
        self.reference = self.stub.Score(REFERENCE, timeout=CALL_TIMEOUT_S)
        assert list(self.reference.errors) == ["", "", ""]

    def assert_unchanged(self, what: str) -> None:
        assert self.stub.Score(REFERENCE, timeout=CALL_TIMEOUT_S) == self.reference, f"{what} changed the reward role"

    def check(self, outcome: Outcome, request_type, what: str, mutates: bool = False) -> None:
        if not outcome.ok:
            check_refused(outcome, request_type, what)
        self.assert_unchanged(what)

    def assert_still_serves(self) -> None:
        self.assert_unchanged("fuzzing")


@pytest.fixture(scope="module")
def reward():
    core = RewardCore(RewardSection(sources=REWARD_SOURCES, max_items_per_request=MAX_ITEMS,
                                    max_item_bytes=MAX_ITEM_BYTES, user_workers=1, user_timeout_s=5.0,
                                    env={"name": "tools", "workers": 1, "timeout_s": 5.0}))
    served = ServedRole("reward", lambda server: reward_server.add_to_server(core, server))
    try:
        yield Scorer(served)
    finally:
        served.close()
        core.close()


json_values = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | weird_text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(weird_text, inner, max_size=3),
                           max_leaves=8)
extra_jsons = st.one_of(
    st.just(""), json_values.map(lambda v: json.dumps({"k": v})), weird_text,
    st.sampled_from(["[1]", "{", "}", "null", "1", '"s"', "[]", '{"a":}', "{'a': 1}", "\x00", '{"a": 1}garbage',
                     '{"a": ' + "1" * 5000 + "}", '{"a": NaN, "b": -Infinity}', '{"\\ud800": 1}']),
    st.integers(1, 3000).map(lambda depth: '{"a": ' + "[" * depth + "]" * depth + "}"),
    st.integers(1, 2000).map(lambda depth: '{"a": ' * depth + "1" + "}" * depth),
)
score_texts = st.one_of(weird_text, st.integers().map(str), st.floats().map(str),
                        st.sampled_from(["\\boxed{", "\\boxed{\\frac{1}{0}}", "#### ", "#### 1e999", "<a>\x00</a>",
                                         "\u00e9" * (MAX_ITEM_BYTES // 2 + 1)]))
score_items = st.builds(reward_pb2.ScoreItem, prompt=score_texts, response=score_texts, ground_truth=score_texts,
                        extra_json=extra_jsons)
score_requests = st.one_of(
    st.lists(score_items, max_size=4),
    st.integers(MAX_ITEMS + 1, 64).map(lambda k: [reward_pb2.ScoreItem(prompt="1+1=", response="2")] * k),
).map(lambda items: reward_pb2.ScoreRequest(items=items))


env_messages = st.lists(st.builds(common_pb2.ChatMessage, role=st.one_of(st.sampled_from(["assistant", "tool", "user"]),
                                                                        weird_text),
                                  content=st.one_of(score_texts, st.sampled_from([
                                      "<tool_call>", "<tool_call>{}</tool_call>", '<tool_call>{"name": 1}</tool_call>',
                                      '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}'
                                      '</tool_call>', '<tool_call>{"name": "python", "arguments": "x"}</tool_call>']))),
                        max_size=3)
env_requests = st.lists(st.builds(reward_pb2.EnvStepItem, prompt=score_texts, ground_truth=score_texts,
                                  extra_json=extra_jsons, messages=env_messages), max_size=3).map(
    lambda items: reward_pb2.EnvStepRequest(items=items))


@pytest.mark.multiturn
def test_reward_step(reward):
    assert call(reward.stub.Step, ENV_REFERENCE).replies[0].outcomes[0].observation[0].content == "42"

    @settings(FUZZ, max_examples=40)
    @given(env_requests)
    def fuzz(request):
        outcome = call(reward.stub.Step, request)
        reward.check(outcome, reward_pb2.EnvStepRequest, "Step")
        if outcome.ok:  # an outcome per conversation; a bad turn is an error outcome, never a failed call
            [reply] = outcome.replies
            assert len(reply.outcomes) == len(request.items)

    fuzz()


def test_reward_score(reward):
    names = [source.name for source in reward.reference.sources]

    @settings(FUZZ, max_examples=60)
    @given(score_requests)
    @example(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(extra_json="[" * 100_000 + "]" * 100_000)]))
    @example(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(extra_json='{"a": ' + "[" * 900 + "]" * 900 + "}")]))
    def fuzz(request):
        outcome = call(reward.stub.Score, request)
        reward.check(outcome, reward_pb2.ScoreRequest, "Score")
        if outcome.ok:  # per-item errors, never a malformed result
            [reply], n = outcome.replies, len(request.items)
            assert list(reply.scores.shape) == [n] and len(reply.errors) == n
            assert [s.name for s in reply.sources] == names and all(list(s.scores.shape) == [n] for s in reply.sources)

    fuzz()


# --- the coordinator ------------------------------------------------------------------------------

class Run:
    """The coordinator's run under fuzzing: a refused call leaves it running; a Stop that decodes is a
    real stop (checked, then the run is set running again)."""

    def __init__(self, status: RunStatus, served: ServedRole):
        self.status, self.served = status, served

    def assert_unchanged(self, what: str) -> None:
        assert (self.status.state, self.status.stop_requested) == (RunState.RUNNING, False), f"{what} changed the run"

    def check(self, outcome: Outcome, request_type, what: str, mutates: bool = False) -> None:
        if outcome.ok and mutates:
            assert self.status.stop_requested and outcome.replies[0] != b""
            self.status.state, self.status.stop_requested = RunState.RUNNING, False
        if not outcome.ok:
            check_refused(outcome, request_type, what)
        self.assert_unchanged(what)

    def assert_still_serves(self) -> None:
        status = self.served.channel.unary_unary("/rolefleet.v1.CoordinatorService/GetRunStatus",
                                                 response_deserializer=coordinator_pb2.RunStatus.FromString)
        reply = status(coordinator_pb2.GetRunStatusRequest().SerializeToString(), timeout=CALL_TIMEOUT_S)
        assert (reply.run_name, reply.state, reply.step) == ("fuzz", RunState.RUNNING, 3)


@pytest.fixture(scope="module")
def coordinator():
    status = RunStatus("fuzz", total_steps=10, state=RunState.RUNNING, step=3, policy_version=3)
    served = ServedRole("coordinator", lambda server: coordinator_server.add_to_server(status, server))
    try:
        yield Run(status, served)
    finally:
        served.close()


# --- bytes that are not the method's message, or are it with unknown fields ----------------------

METHODS = {
    "actor": trainer_methods("ActorService", actor_pb2.ActorUpdateRequest, actor_update, [
        Method("ActorService", "Generate", actor_pb2.GenerateRequest, lambda t: generate_request({}), streaming=True),
        Method("ActorService", "ComputeLogProbs", actor_pb2.ComputeLogProbsRequest,
               lambda t: actor_pb2.ComputeLogProbsRequest(batch=GOOD_BATCH.to_proto(), temperature=1.0))]),
    "critic": trainer_methods("CriticService", critic_pb2.CriticUpdateRequest, critic_update, [
        Method("CriticService", "ComputeValues", critic_pb2.ComputeValuesRequest,
               lambda t: critic_pb2.ComputeValuesRequest(batch=GOOD_BATCH.to_proto()))]),
    "reward": [Method("RewardService", "Score", reward_pb2.ScoreRequest, lambda r: REFERENCE),
               Method("RewardService", "Step", reward_pb2.EnvStepRequest, lambda r: ENV_REFERENCE),
               Method("RewardService", "GetStatus", common_pb2.GetStatusRequest,
                      lambda r: common_pb2.GetStatusRequest(include_weights_digest=True))],
    "coordinator": [Method("CoordinatorService", "GetRunStatus", coordinator_pb2.GetRunStatusRequest,
                           lambda c: coordinator_pb2.GetRunStatusRequest()),
                    Method("CoordinatorService", "Stop", coordinator_pb2.StopRequest,
                           lambda c: coordinator_pb2.StopRequest(), mutates=True)],
}

@pytest.mark.parametrize("role", list(METHODS))
def test_garbage_bytes_change_nothing(role, request):
    """Every method of every role: random bytes, valid requests truncated, flipped or extended. An
    undecodable request is refused and changes nothing; one with unknown fields is served as without."""
    under_test = request.getfixturevalue(role)

    @settings(FUZZ, max_examples=80)
    @given(st.sampled_from(METHODS[role]), garbage)
    def fuzz(method, recipe):
        data = garbled(method.valid(under_test).SerializeToString(), recipe)
        outcome = call(under_test.served.raw(method.path, method.streaming), data, method.streaming)
        what = f"{method.name} <- {data[:48]!r}"
        assert outcome.code != Code.DEADLINE_EXCEEDED, f"{what}: no answer before the deadline"
        if not decodes(method.request_type, data):
            assert not outcome.ok, f"{what}: undecodable, yet answered OK"
            under_test.assert_unchanged(what)
            return
        if recipe[0] == "unknown":  # proto3 ignores fields it does not know
            assert outcome.ok, f"{what}: {outcome.code.name}: {outcome.details}"
        under_test.check(outcome, method.request_type, what, mutates=method.mutates)

    fuzz()
    under_test.assert_still_serves()


# The decode guard answers INVALID_ARGUMENT where gRPC itself answers INTERNAL.
@pytest.mark.parametrize("role", list(METHODS))
def test_undecodable_requests_get_invalid_argument(role, request):
    under_test = request.getfixturevalue(role)

    @settings(FUZZ, max_examples=25)
    @given(st.sampled_from(METHODS[role]), st.one_of(st.sampled_from(UNDECODABLE), st.binary(min_size=1, max_size=64)))
    def fuzz(method, data):
        assume(not decodes(method.request_type, data))
        outcome = call(under_test.served.raw(method.path, method.streaming), data, method.streaming)
        assert outcome.code == Code.INVALID_ARGUMENT and "request" in outcome.details, (outcome.code, outcome.details)
        under_test.assert_unchanged(method.name)

    fuzz()


def test_coordinator_still_answers_and_stops(coordinator):
    coordinator.assert_still_serves()
    stop = coordinator.served.channel.unary_unary("/rolefleet.v1.CoordinatorService/Stop",
                                                  response_deserializer=coordinator_pb2.StopResponse.FromString)
    assert stop(b"", timeout=CALL_TIMEOUT_S).state == RunState.STOPPING and coordinator.status.stop_requested
    coordinator.status.state, coordinator.status.stop_requested = RunState.RUNNING, False


# --- checkpoint requests that once crashed or destroyed: each refused, nothing changed ------------

def test_save_onto_a_regular_file_is_refused(actor):
    target = actor.root / "a-file"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("not a directory")
    request = common_pb2.SaveCheckpointRequest(step=actor.last_step, path=str(target))
    try:
        actor.check(call(actor.stub.SaveCheckpoint, request), common_pb2.SaveCheckpointRequest, "Save onto a file")
        assert not Path(f"{target}.partial").exists() and target.read_text() == "not a directory"
    finally:
        shutil.rmtree(f"{target}.partial", ignore_errors=True)
        target.unlink()


@pytest.mark.parametrize("role_json", ['{"model_version": 0, "last_step": 0, "results": []}', "[1]"])
def test_load_of_a_directory_without_weights_is_refused(actor, role_json):
    decoy = actor.root / "decoy"
    decoy.mkdir(parents=True, exist_ok=True)
    (decoy / "role.json").write_text(role_json)
    try:
        outcome = call(actor.stub.LoadCheckpoint, common_pb2.LoadCheckpointRequest(path=str(decoy)), timeout=3)
        actor.check(outcome, common_pb2.LoadCheckpointRequest, "Load of a directory without weights")
    finally:
        shutil.rmtree(decoy)


def test_save_onto_a_directory_that_is_no_checkpoint_deletes_nothing(actor):
    # A checkpoint root of its own: the fuzzing before may have saved a checkpoint onto actor.root
    # itself (a path it tries), which makes that one a checkpoint of this role.
    root = actor.root / "a-checkpoint-root"
    other = root / "step-00000001" / "critic"
    other.mkdir(parents=True, exist_ok=True)
    (other / "role.json").write_text("{}")
    request = common_pb2.SaveCheckpointRequest(step=actor.last_step, path=str(root))
    outcome = call(actor.stub.SaveCheckpoint, request)
    actor.check(outcome, common_pb2.SaveCheckpointRequest, "Save onto the checkpoint root")
    assert (other / "role.json").is_file()

"""The actor over real gRPC on an ephemeral loopback port, through the gRPC client and raw stubs."""

import asyncio
import time

import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolefleet.actor import server as actor_server
from rolefleet.actor.client import GrpcActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.errors import FailedPrecondition
from rolefleet.common.pb import actor_pb2, actor_pb2_grpc, common_pb2
from rolefleet.rpc.roles import open_channel
from tests.helpers import expect_invalid, serving


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    from rolefleet.common.config import parse_config

    return ActorCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}}, ["actor.compute_dtype=float32"]).actor)


async def status_and_good_update(stub):
    """The actor's status (with digest), a valid one-sequence batch and a valid Update for it."""
    before = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
    batch = SequenceBatch.from_lists([torch.tensor([4, 41])], [torch.tensor([5, 2])])
    good = dict(step=before.last_step + 1, policy_version=before.model_version, batch=batch.to_proto(),
                temperature=1.0, advantages=codec.encode(torch.ones(2)), old_logprobs=codec.encode(torch.zeros(2)))
    return before, batch, good


async def assert_unchanged_and_serving(stub, before, good):
    """Nothing changed (version, step, weights), and the valid request is still applied."""
    after = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
    assert (after.model_version, after.last_step, after.weights_digest) == \
        (before.model_version, before.last_step, before.weights_digest)
    reply = await stub.Update(actor_pb2.ActorUpdateRequest(**good))
    assert reply.policy_version == before.model_version + 1


def test_generate_logprobs_update_status_over_grpc(core):
    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            client = GrpcActorClient(address, timeout_s=60)
            samples = await client.generate(["2+3=", "11+1="], SamplingParams(max_new_tokens=3, n=2, seed=3))
            assert len(samples) == 4 and {s.prompt_index for s in samples} == {0, 1}
            batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
            lp = await client.compute_logprobs(batch, 1.0, include_reference=True)
            assert torch.allclose(lp.logprobs, torch.cat([s.logprobs for s in samples]), atol=1e-4)
            before = await client.status(include_digest=True)
            targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
            result = await client.update(before.last_step + 1, before.model_version, batch, targets, 1.0)
            after = await client.status(include_digest=True)
            assert after.model_version == result.model_version == before.model_version + 1
            assert after.weights_digest != before.weights_digest and after.last_step == before.last_step + 1
            with pytest.raises(FailedPrecondition):  # gRPC status maps back to the domain error
                await client.update(after.last_step + 1, before.model_version, batch, targets, 1.0)
            async with open_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await client.close()

    asyncio.run(scenario())


def test_malformed_requests_get_invalid_argument_and_change_nothing(core):
    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                before, batch, good = await status_and_good_update(stub)
                bad_updates = {
                    "advantages.shape": dict(good, advantages=codec.encode(torch.ones(3))),
                    "old_logprobs.data": dict(good, old_logprobs=common_pb2.Tensor(dtype="float32", shape=[2], data=b"x")),
                    "batch.response_ids.dtype": dict(good, batch=common_pb2.SequenceBatch(
                        prompt_ids=codec.encode(torch.tensor([4, 41])), prompt_lengths=codec.encode(torch.tensor([2])),
                        response_ids=codec.encode(torch.tensor([5.0, 2.0])), response_lengths=codec.encode(torch.tensor([2])))),
                    "batch.prompt_ids": dict(good, batch=SequenceBatch.from_lists(
                        [torch.tensor([10_000])], [torch.tensor([5, 2])]).to_proto()),
                    "temperature": dict(good, temperature=0.0),
                    # The teacher's top k (on-policy distillation's KL term): [N, k], in the vocabulary,
                    # a position's probabilities summing to at most 1.
                    "teacher_top_ids.shape": dict(good, teacher_top_ids=codec.encode(torch.ones(3, 2, dtype=torch.int64)),
                                                  teacher_top_logprobs=codec.encode(torch.full((3, 2), -2.0))),
                    "teacher_top_ids": dict(good, teacher_top_ids=codec.encode(torch.full((2, 2), 10_000)),
                                            teacher_top_logprobs=codec.encode(torch.full((2, 2), -2.0))),
                    "teacher_top_logprobs": dict(good, teacher_top_ids=codec.encode(torch.ones(2, 2, dtype=torch.int64)),
                                                 teacher_top_logprobs=codec.encode(torch.zeros(2, 2))),
                }
                for field, fields in bad_updates.items():
                    await expect_invalid(stub.Update(actor_pb2.ActorUpdateRequest(**fields)), field)
                await expect_invalid(stub.ComputeLogProbs(actor_pb2.ComputeLogProbsRequest(
                    batch=batch.to_proto(), temperature=-1.0)), "temperature")
                await expect_invalid(stub.ComputeLogProbs(actor_pb2.ComputeLogProbsRequest(temperature=1.0)),
                                     "batch.prompt_ids.dtype")
                stream = stub.Generate(actor_pb2.GenerateRequest(prompts=["1+1="]))  # sampling unset
                await expect_invalid(stream.read(), "sampling")
                stream = stub.Generate(actor_pb2.GenerateRequest(prompts=["1+1="], sampling=actor_pb2.SamplingParams(
                    temperature=1.0, top_p=1.0, max_new_tokens=4, n=1, stop_token_ids=[1 << 30])))
                await expect_invalid(stream.read(), "sampling.stop_token_ids[0]")
                await assert_unchanged_and_serving(stub, before, good)

    asyncio.run(scenario())


def test_a_cancelled_stream_releases_the_model(tiny_model_dir):
    from rolefleet.common.config import parse_config

    core = ActorCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                                  ["actor.rollout.batch_size=1"]).actor)

    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                sampling = actor_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, n=4, seed=1)
                call = stub.Generate(actor_pb2.GenerateRequest(prompts=["1+2="] * 8, sampling=sampling))
                first = await call.read()  # one forward batch of one sequence is out
                assert first.prompt_index == 0
                call.cancel()
                # The model lock is released: a new request is served in full.
                client = GrpcActorClient(address, timeout_s=30)
                samples = await asyncio.wait_for(
                    client.generate(["3+4="], SamplingParams(max_new_tokens=3, n=2, seed=2)), timeout=30)
                assert len(samples) == 2
                await client.close()

    asyncio.run(scenario())


def test_hostile_requests_are_refused_and_change_nothing(core):
    """Each wire case a hostile or buggy client sends: a clear status naming what is wrong, the same
    status and weights afterwards, and a valid request still served."""
    import grpc

    from tests.helpers import expect_code

    code = grpc.StatusCode

    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                before, batch, good = await status_and_good_update(stub)
                many = SequenceBatch.from_lists([torch.tensor([4])] * 70_000, [torch.tensor([5])] * 70_000)
                deep = common_pb2.Tensor(dtype="int64", shape=[0] * 65)
                wide_batch = batch.to_proto()
                wide_batch.response_ids.CopyFrom(common_pb2.Tensor(dtype="int64", shape=[0, 2**62]))
                long = SequenceBatch.from_lists([torch.full((core.max_positions,), 4)], [torch.tensor([5])])
                cases = [
                    (lambda: stub.Update(actor_pb2.ActorUpdateRequest(**dict(good, step=2**63 - 1))),
                     code.FAILED_PRECONDITION, f"expects step {before.last_step + 1} next"),
                    (lambda: stub.Update(actor_pb2.ActorUpdateRequest(**dict(good, temperature=1e-45))),
                     code.INVALID_ARGUMENT, "temperature"),
                    (lambda: stub.Update(actor_pb2.ActorUpdateRequest(**dict(good, temperature=float("nan")))),
                     code.INVALID_ARGUMENT, "temperature"),
                    (lambda: stub.Update(actor_pb2.ActorUpdateRequest(**dict(good, batch=many.to_proto()))),
                     code.RESOURCE_EXHAUSTED, "actor.max_sequences_per_request"),
                    (lambda: stub.ComputeLogProbs(actor_pb2.ComputeLogProbsRequest(batch=batch.to_proto(),
                                                                           temperature=1e-45)),
                     code.INVALID_ARGUMENT, "temperature"),
                    (lambda: stub.ComputeLogProbs(actor_pb2.ComputeLogProbsRequest(
                        batch=common_pb2.SequenceBatch(prompt_ids=deep), temperature=1.0)),
                     code.INVALID_ARGUMENT, "batch.prompt_ids.shape"),
                    (lambda: stub.ComputeLogProbs(actor_pb2.ComputeLogProbsRequest(
                        batch=wide_batch, temperature=1.0)),
                     code.INVALID_ARGUMENT, "batch.response_ids.shape"),
                    (lambda: stub.ComputeLogProbs(actor_pb2.ComputeLogProbsRequest(batch=long.to_proto(), temperature=1.0)),
                     code.INVALID_ARGUMENT, "positions"),
                    (lambda: stub.Generate(actor_pb2.GenerateRequest(
                        prompts=["1+1=", "9" * 10_000_000], sampling=actor_pb2.SamplingParams(
                            temperature=1.0, top_p=1.0, max_new_tokens=2, n=1))).read(),
                     code.RESOURCE_EXHAUSTED, "prompts[1]", "actor.max_prompt_bytes"),
                    (lambda: stub.Generate(actor_pb2.GenerateRequest(prompts=["1+1="], sampling=actor_pb2.SamplingParams(
                        temperature=1e-45, top_p=1.0, max_new_tokens=2, n=1))).read(),
                     code.INVALID_ARGUMENT, "sampling.temperature"),
                ]
                for call, expected, *texts in cases:
                    started = time.perf_counter()
                    await expect_code(call(), expected, *texts)
                    assert time.perf_counter() - started < 5, texts  # refused up front, not after the work
                await assert_unchanged_and_serving(stub, before, good)

    asyncio.run(scenario())


def test_status_answers_at_once_while_the_model_is_busy(core):
    """GetStatus never waits behind the model lock (a rollout or update may hold it for minutes);
    only a digest request does."""
    import grpc

    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                digest = (await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))).weights_digest
                assert len(digest) == 64
                with core._lock:  # as during a long rollout
                    started = time.perf_counter()
                    status = await stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
                    assert time.perf_counter() - started < 1.0
                    assert status.role == "actor" and status.weights_digest == "" and status.requests_served >= 2
                    with pytest.raises(grpc.aio.AioRpcError) as err:  # the digest does wait for the model
                        await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True), timeout=0.5)
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(scenario())

"""Out of device memory, forced on the CPU by a fake allocator limit in the model's forward: the
call answers RESOURCE_EXHAUSTED naming the phase and the settings that lower it, nothing changes,
the role stays SERVING, and a smaller request succeeds."""

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolefleet.actor import server as actor_server
from rolefleet.actor.core import ActorCore
from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.pb import actor_pb2, actor_pb2_grpc, common_pb2
from rolefleet.common.roles import open_channel
from tests.helpers import serving

LIMIT = 40  # tokens one forward may hold under the fake allocator


def limited(forward):
    def run(*args, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.numel() > LIMIT:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake allocator)")
        return forward(*args, input_ids=input_ids, **kwargs)

    return run


def update_request(step, version, rows: int):
    batch = SequenceBatch.from_lists([torch.tensor([4, 41, 7, 9])] * rows, [torch.tensor([5, 6, 2])] * rows)
    n = batch.num_response_tokens
    return actor_pb2.ActorUpdateRequest(step=step, policy_version=version, batch=batch.to_proto(), temperature=1.0,
                                        advantages=codec.encode(torch.ones(n)), old_logprobs=codec.encode(-torch.ones(n)))


def test_an_update_out_of_memory_names_phase_and_settings_and_a_smaller_one_succeeds(tiny_model_dir, monkeypatch):
    core = ActorCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                                  ["actor.compute_dtype=float32", "actor.max_tokens_per_micro_batch=100000"]).actor)
    backbone = core.model.base_model
    monkeypatch.setattr(backbone, "forward", limited(backbone.forward))

    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                before = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Update(update_request(1, 0, rows=20))  # 20 x 7 tokens: over the limit
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = err.value.details()
                assert details.startswith("actor update: out of device memory")
                assert "actor.max_tokens_per_micro_batch" in details and "actor.gradient_checkpointing" in details
                after = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                assert (after.model_version, after.last_step, after.weights_digest) == \
                    (before.model_version, before.last_step, before.weights_digest)
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                reply = await stub.Update(update_request(1, 0, rows=2))  # 14 tokens: fits
                assert reply.policy_version == 1

    asyncio.run(scenario())


def test_every_phase_names_its_settings():
    from rolefleet.common.oom import explain

    err = explain("critic", "ComputeValues", torch.OutOfMemoryError("CUDA out of memory."))
    assert err.field == "critic values" and "critic.max_tokens_per_micro_batch" in str(err)
    err = explain("reward", "Score", torch.OutOfMemoryError(""))
    assert err.field == "reward model" and "reward.model_max_tokens_per_batch" in str(err)

"""Out of device memory, forced on the CPU by a fake allocator limit in the model's forward: the
call answers RESOURCE_EXHAUSTED naming the phase and the settings that lower it, nothing changes,
the role stays SERVING, and a smaller request succeeds."""

import asyncio
import weakref

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
from rolefleet.rpc.roles import open_channel
from tests.helpers import serving

LIMIT = 40  # tokens one forward may hold under the fake allocator


def limited(forward, held: list | None = None):
    """`forward` under the fake limit; a forward over it first allocates an activation (a weak
    reference to it goes to `held`), as a real one does before the allocation that fails."""
    def run(*args, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.numel() > LIMIT:
            activation = torch.empty(input_ids.numel(), 4096)
            if held is not None:
                held.append(weakref.ref(activation))
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
    backbone = core.worker.model.base_model
    held: list[weakref.ref] = []
    monkeypatch.setattr(backbone, "forward", limited(backbone.forward, held))

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
                # Freed as the error was answered: the traceback's frames no longer hold the activation.
                assert held and held[0]() is None
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_oversized_update_on_the_gpu_answers_resource_exhausted_and_a_smaller_one_succeeds(tmp_path):
    """0.5B dimensions on one GPU: an Update of 64 sequences of 8k tokens in one micro-batch needs
    the logits alone at 150 GB. The allocator's own failure must come back as RESOURCE_EXHAUSTED
    with the phase and the settings, the memory must be given back, and the next Update fit."""
    from rolefleet.app.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", shape="qwen2-0.5b")
    core = ActorCore(parse_config({"model": {"model_name_or_path": str(model)}},
                                  ["actor.rollout.backend=hf", "actor.compute_dtype=bfloat16",
                                   "actor.max_tokens_per_micro_batch=1000000"]).actor)

    def request(rows: int, response_tokens: int):
        prompt, response = torch.arange(8) + 10, torch.arange(response_tokens) % 1000 + 10
        batch = SequenceBatch.from_lists([prompt] * rows, [response] * rows)
        n = batch.num_response_tokens
        return actor_pb2.ActorUpdateRequest(step=1, policy_version=0, batch=batch.to_proto(), temperature=1.0,
                                            advantages=codec.encode(torch.ones(n)),
                                            old_logprobs=codec.encode(-torch.ones(n)))

    async def scenario():
        async with serving("actor", lambda s: actor_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                before = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                held = torch.cuda.memory_allocated()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Update(request(64, 8000))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
                details = err.value.details()
                assert details.startswith("actor update: out of device memory on cuda:0: "), details
                assert "GiB in use" in details and "actor.max_tokens_per_micro_batch" in details
                # What the failed call allocated went back (the optimizer state of a first step may stay).
                assert torch.cuda.memory_allocated() - held < 8 * 2**30
                after = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                assert (after.model_version, after.weights_digest) == (before.model_version, before.weights_digest)
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                assert (await stub.Update(request(4, 64))).policy_version == 1
                print(f"OOM answer on the GPU: {details}")

    asyncio.run(scenario())

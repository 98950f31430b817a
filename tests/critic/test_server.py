import asyncio

import pytest
import torch

from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.pb import common_pb2, critic_pb2, critic_pb2_grpc
from rolefleet.common.roles import open_channel
from rolefleet.critic import server as critic_server
from rolefleet.critic.client import GrpcCriticClient
from rolefleet.critic.core import CriticCore
from tests.helpers import expect_invalid, serving

BATCH = SequenceBatch.from_lists([torch.tensor([4, 41, 5, 45]), torch.tensor([6, 45])],
                                 [torch.tensor([9, 2]), torch.tensor([10, 4, 2])])


@pytest.fixture
def core(tiny_model_dir):
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}, "critic": {"lr": 1e-2}})
    return CriticCore(cfg.critic)


def test_values_start_at_zero_and_move_toward_returns(core):
    values = core.compute_values(BATCH)
    assert values.shape == (5,) and torch.all(values == 0)  # zero-initialised head
    returns = torch.ones(5)
    for step in range(1, 6):
        core.update(step, BATCH, returns, core.compute_values(BATCH))
    assert core.compute_values(BATCH).mean() > 0.2
    assert core.model_version == 5


def test_update_over_grpc_changes_weights_and_replays_repeats(core):
    async def scenario():
        async with serving("critic", lambda s: critic_server.add_to_server(core, s)) as address:
            client = GrpcCriticClient(address, timeout_s=30)
            before = await client.status(include_digest=True)
            values = await client.compute_values(BATCH)
            result = await client.update(1, BATCH, torch.ones(5), values)
            after = await client.status(include_digest=True)
            assert after.weights_digest != before.weights_digest and after.model_version == 1
            assert {"vf_loss", "vf_clipfrac"} <= set(result.stats)
            assert await client.update(1, BATCH, torch.ones(5), values) == result
            assert (await client.status(include_digest=True)).weights_digest == after.weights_digest
            await client.close()

    asyncio.run(scenario())


def test_malformed_requests_get_invalid_argument_and_change_nothing(core):
    async def scenario():
        async with serving("critic", lambda s: critic_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = critic_pb2_grpc.CriticServiceStub(channel)
                before = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                await expect_invalid(stub.ComputeValues(critic_pb2.ComputeValuesRequest(
                    batch=common_pb2.SequenceBatch(prompt_ids=common_pb2.Tensor(dtype="int128")))),
                    "batch.prompt_ids.dtype")
                await expect_invalid(stub.Update(critic_pb2.CriticUpdateRequest(
                    step=1, batch=BATCH.to_proto(), returns=codec.encode(torch.ones(4)),
                    old_values=codec.encode(torch.zeros(5)))), "returns.shape")
                await expect_invalid(stub.Update(critic_pb2.CriticUpdateRequest(
                    step=1, batch=BATCH.to_proto(), returns=codec.encode(torch.ones(5)),
                    old_values=codec.encode(torch.full((5,), float("inf"))))), "old_values")
                await expect_invalid(stub.Update(critic_pb2.CriticUpdateRequest(
                    step=-3, batch=BATCH.to_proto(), returns=codec.encode(torch.ones(5)),
                    old_values=codec.encode(torch.zeros(5)))), "step")
                after = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                assert after.weights_digest == before.weights_digest and after.model_version == 0
                values = await stub.ComputeValues(critic_pb2.ComputeValuesRequest(batch=BATCH.to_proto()))
                assert list(values.values.shape) == [5]

    asyncio.run(scenario())


def test_old_values_reach_the_clipped_value_loss(core):
    seen = []
    real = core.value_loss

    def spy(values, old_values, returns, mask, value_clip):
        seen.append((old_values.clone(), value_clip))
        return real(values, old_values, returns, mask, value_clip)

    core.value_loss = spy
    old = torch.tensor([0.5, -0.5, 1.0, 2.0, 3.0])
    core.update(1, BATCH, torch.ones(5), old)
    assert seen and all(torch.equal(o.cpu().sort().values, old.sort().values) and c == 0.2 for o, c in seen)


def test_oversized_and_out_of_order_requests_are_refused_and_change_nothing(tiny_model_dir):
    import grpc

    from tests.helpers import expect_code

    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                       ["critic.max_sequences_per_request=4", "critic.max_tokens_per_request=64"])
    core = CriticCore(cfg.critic)
    five = SequenceBatch.from_lists([torch.tensor([4])] * 5, [torch.tensor([5])] * 5)
    fat = SequenceBatch.from_lists([torch.full((40,), 4)], [torch.full((30,), 5)])

    def update(step, batch=BATCH):
        n = batch.num_response_tokens
        return critic_pb2.CriticUpdateRequest(step=step, batch=batch.to_proto(), returns=codec.encode(torch.ones(n)),
                                              old_values=codec.encode(torch.zeros(n)))

    async def scenario():
        async with serving("critic", lambda s: critic_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = critic_pb2_grpc.CriticServiceStub(channel)
                before = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
                await expect_code(stub.ComputeValues(critic_pb2.ComputeValuesRequest(batch=five.to_proto())),
                                  exhausted, "critic.max_sequences_per_request=4")
                await expect_code(stub.ComputeValues(critic_pb2.ComputeValuesRequest(batch=fat.to_proto())),
                                  exhausted, "70 prompt + response tokens exceed critic.max_tokens_per_request=64")
                await expect_code(stub.Update(update(1, fat)), exhausted, "critic.max_tokens_per_request")
                await expect_code(stub.Update(update(2**63 - 1)), grpc.StatusCode.FAILED_PRECONDITION,
                                  "expects step 1 next")
                after = await stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True))
                assert (after.weights_digest, after.model_version, after.last_step) == \
                    (before.weights_digest, 0, 0)
                reply = await stub.Update(update(1))  # the next step is still accepted
                assert reply.model_version == 1

    asyncio.run(scenario())

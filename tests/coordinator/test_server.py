"""The coordinator's control service over real gRPC: run status and stop."""

import asyncio

from rolefleet.coordinator import server as coordinator_server
from rolefleet.coordinator.client import run_status, stop_run
from rolefleet.coordinator.state import RunState, RunStatus
from tests.helpers import serving


def test_status_and_stop_over_grpc():
    status = RunStatus("r1", total_steps=10, state=RunState.RUNNING, step=3, policy_version=3,
                       last_reward_mean=0.5)

    async def scenario():
        async with serving("coordinator", lambda s: coordinator_server.add_to_server(status, s)) as address:
            reply = await run_status(address)
            assert (reply.run_name, reply.state, reply.step, reply.total_steps, reply.policy_version) == \
                ("r1", RunState.RUNNING, 3, 10, 3)
            assert reply.last_reward_mean == 0.5
            stopped = await stop_run(address)
            assert stopped.state == RunState.STOPPING and status.stop_requested
            assert (await run_status(address)).state == RunState.STOPPING

    asyncio.run(scenario())


def test_stop_after_the_run_ended_keeps_its_final_state():
    status = RunStatus("r2", total_steps=1, state=RunState.FINISHED)
    status.request_stop()
    assert status.state == RunState.FINISHED


def test_status_lists_each_role_and_says_which_did_not_answer(monkeypatch):
    """A reward server that answers (its GPUs from CUDA_VISIBLE_DEVICES) and a critic address where
    nothing listens: the status names both, and the silent one's error."""
    import socket

    from rolefleet.common.config import RewardSection
    from rolefleet.reward import server as reward_server
    from rolefleet.reward.core import RewardCore

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    status = RunStatus("r3", total_steps=1, state=RunState.RUNNING)

    async def scenario():
        async with serving("reward", lambda s: reward_server.add_to_server(RewardCore(RewardSection(function="exact_match")), s)) as reward:
            with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
                sock.bind(("127.0.0.1", 0))
                dead = f"127.0.0.1:{sock.getsockname()[1]}"
            addresses = {"reward": reward, "critic": dead}
            async with serving("coordinator", lambda s: coordinator_server.add_to_server(status, s, addresses)) as a:
                reply = await run_status(a)
        [ok, silent] = reply.roles
        assert (ok.address, ok.status.role, ok.status.devices, ok.status.workers) == (reward, "reward", "4,5", 1)
        assert silent.address == dead and not silent.HasField("status") and silent.error.startswith("critic: ")

    asyncio.run(scenario())

"""Environments in the reward role's sandbox (`reward.env`): a user environment that raises, hangs,
dies, runs out of memory or answers something malformed costs the conversation it was answering
(it ends there, with the error), never the server or the others; the built-in tools run the
model's tool calls and count its malformed ones; Step over gRPC checks its input."""

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest

from rolefleet.common.config import ConfigError, RewardSection
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.reward.core import RewardCore
from rolefleet.reward.env_tools import tool_call_text
from rolefleet.reward.server import add_to_server
from rolefleet.reward.types import EnvItem
from tests.e2e.procs import children_of
from tests.helpers import expect_code, expect_invalid, serving

pytestmark = [pytest.mark.multiturn, pytest.mark.procs]
USER_FILE = Path(__file__).with_name("user_envs.py")
# The hung conversation waits this long; the others (a 256 MiB allocation among them) must finish
# well within it on a loaded 2-core CI machine, where 1 s was once too little for the allocation.
TIMEOUT_S = 2.0


def workers() -> list[int]:
    return [pid for pid in children_of(os.getpid())
            if b"sandbox_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def user_core():
    core = RewardCore(RewardSection(env={"path": f"{USER_FILE}:step", "workers": 2, "timeout_s": TIMEOUT_S,
                                         "memory_mb": 256}))
    yield core
    core.close()
    assert workers() == []


def item(turn: str, **extra) -> EnvItem:
    return EnvItem("What is 6 * 7?", "42", [{"role": "assistant", "content": turn}], extra)


EXPECTED = {
    "raise": "raised KeyError: 'no such state'",
    "sleep": f"timed out after {TIMEOUT_S:g} s (reward.env.timeout_s), its worker killed and replaced",
    "exit": "its worker died (exited with code 3) and was replaced",
    "alloc": "ran out of memory (MemoryError, over reward.env.memory_mb=256), its worker replaced",
    "not a dict": "returned 'done', not a dict with observation and done",
    "no done": "returned done=None, not a bool",
    "bad observation": "returned an observation that is not a str or a list of {role: str, content: str} messages",
    "open without observation": "returned done=False with no observation to continue with",
    "nan reward": "reward: returned nan, not a finite float32 number",
    "unknown key": "returned unknown key(s) score; known: done, observation, reward, tool_calls, tool_errors, "
                   "tool_timeouts",
}


def test_a_misbehaving_environment_costs_only_its_conversations(user_core):
    before = workers()
    start = time.monotonic()
    outcomes = user_core.step([item("41"), *(item(t) for t in EXPECTED), item("42", bonus=2)])
    assert time.monotonic() - start < 10 * TIMEOUT_S  # the hung one was killed at its deadline
    first, *bad, last = outcomes
    assert first.observation == [{"role": "user", "content": "not 41; What is 6 * 7? again"}] and not first.done
    assert [o.error for o in bad] == list(EXPECTED.values())
    assert all(o.done and o.observation == [] for o in bad)  # each failed conversation ends there
    assert last.done and last.reward == 3.0 and not last.error  # extra reaches the environment
    time.sleep(0.5)
    assert not set(before) & set(workers()) and len(workers()) == 2  # the dead and killed were replaced
    assert user_core.step([item("42")])[0].reward == 1.0


@pytest.fixture(scope="module")
def tools_core():
    core = RewardCore(RewardSection(env={"name": "tools", "options": {"python_timeout_s": 1.0}, "workers": 1}))
    yield core
    core.close()


def test_the_tools_environment_runs_tool_calls_and_counts_the_bad_ones(tools_core):
    calc = tool_call_text("calculator", {"expression": "347 * 29"})
    py = tool_call_text("python", {"code": "print(sum(range(10)))"})
    hang = tool_call_text("python", {"code": "while True: pass"})
    broken = "<tool_call>{\"name\": \"calculator\", \"arguments\": </tool_call>"
    unknown = tool_call_text("browser", {"url": "x"})
    answered, calls, timeout, bad, plain = tools_core.step([
        item(f"Let me compute. {calc}"), item(calc + py), item(hang), item(broken + unknown), item("The answer is 42.")])
    assert answered.observation == [{"role": "tool", "content": "10063"}] and not answered.done
    assert (answered.tool_calls, answered.tool_errors) == (1, 0)
    assert [m["content"] for m in calls.observation] == ["10063", "45"] and calls.tool_calls == 2
    assert timeout.observation[0]["content"] == "error: timed out after 1 s"
    assert (timeout.tool_errors, timeout.tool_timeouts) == (1, 1)
    assert bad.observation[0]["content"].startswith("error: malformed tool call (not JSON")
    assert bad.observation[1]["content"] == "error: unknown tool 'browser'; tools: calculator, python"
    assert (bad.tool_calls, bad.tool_errors, bad.done) == (2, 2, False)  # errors are observations: the model may retry
    assert plain.done and plain.observation == [] and plain.tool_calls == 0


def test_the_feedback_environment_asks_again_once():
    core = RewardCore(RewardSection(env={"name": "feedback", "workers": 1}))
    try:
        wrong, right = core.step([item("It is 41."), item("It is 42.")])
        assert not wrong.done and wrong.observation[0]["role"] == "user" and right.done
        again = EnvItem("q", "42", [{"role": "assistant", "content": "41"}, *wrong.observation,
                                    {"role": "assistant", "content": "40"}])
        assert core.step([again])[0].done  # two answers: max_attempts
    finally:
        core.close()


def test_an_environment_that_cannot_load_is_a_config_error(tmp_path):
    broken = tmp_path / "env.py"
    broken.write_text("import no_such_module\n")
    before = set(workers())
    with pytest.raises(ConfigError, match="reward.env.path: cannot load the environment: ModuleNotFoundError"):
        RewardCore(RewardSection(env={"path": f"{broken}:step", "workers": 1}))
    assert set(workers()) <= before  # its workers were stopped


def test_step_over_grpc_checks_its_input(tools_core):
    asyncio.run(_step_over_grpc(tools_core))


def request(*messages, extra=""):
    return reward_pb2.EnvStepRequest(items=[reward_pb2.EnvStepItem(
        prompt="p", ground_truth="42", extra_json=extra,
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages])])


async def _step_over_grpc(tools_core):
    async with serving("reward", lambda server: add_to_server(tools_core, server)) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            ok = await stub.Step(request(("assistant", tool_call_text("calculator", {"expression": "6*7"}))))
            assert ok.outcomes[0].observation[0].content == "42" and ok.outcomes[0].tool_calls == 1
            await expect_invalid(stub.Step(request(("tool", "x"))), "items[0].messages")
            await expect_invalid(stub.Step(request()), "items[0].messages")
            await expect_invalid(stub.Step(request(("assistant", "x"), extra="[1]")), "items[0].extra_json")
            await expect_invalid(stub.Step(reward_pb2.EnvStepRequest()), "items")
    no_env = RewardCore(RewardSection())
    try:
        async with serving("reward", lambda server: add_to_server(no_env, server)) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                await expect_code(stub.Step(request(("assistant", "x"))), grpc.StatusCode.FAILED_PRECONDITION,
                                  "reward.env.name")
    finally:
        no_env.close()


def test_preflight_names_a_missing_user_environment(tmp_path):
    from rolefleet.reward.sources import check_sources

    assert check_sources(RewardSection(env={"path": f"{USER_FILE}:step"})) == []
    problems = check_sources(RewardSection(env={"path": f"{tmp_path}/none.py:step"}))
    assert problems == [f"reward.env.path: {tmp_path}/none.py does not exist"]
    assert check_sources(RewardSection(env={"path": f"{USER_FILE}:nope"})) == [
        f"reward.env.path: {USER_FILE} defines no 'nope' at its top level"]

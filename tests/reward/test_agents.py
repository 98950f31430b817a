"""Agent code run by the reward role (`reward/agents.py`, the sandbox's `agents` op), against a real
endpoint on loopback: each agent gets an `openai` client of its own session (its key, its base URL),
its session starts from nothing, and an agent that raises, hangs past its deadline or returns no
number costs its own episode alone."""

from __future__ import annotations

import asyncio
import textwrap
import threading

import pytest

from rolefleet.actor.completions import CompletionBatcher
from rolefleet.actor.openai_api import Endpoint
from rolefleet.actor.sessions import SessionLimits, SessionStore
from rolefleet.actor.types import SamplingParams
from rolefleet.common.config import ConfigError
from rolefleet.common.config.reward import AgentSection
from rolefleet.common.errors import FailedPrecondition
from rolefleet.reward.agents import Agents
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import AgentItem
from rolefleet.rpc.http_server import HttpServer

pytestmark = pytest.mark.procs

AGENTS = '''
import asyncio

async def agent(client, prompt, ground_truth, extra):
    if prompt == "models":  # its client reaches its own session's endpoint with its key
        return float(len([m async for m in client.models.list()]))
    if prompt == "raise":
        raise ValueError("no luck")
    if prompt == "hang":
        await asyncio.sleep(60)
    if prompt == "text":
        return "not a number"
    return float(extra["value"])

def not_async(client, prompt, ground_truth, extra):
    return 1.0
'''


@pytest.fixture(scope="module")
def endpoint():
    """An endpoint on loopback with no model (the agents here ask for no completion)."""
    store = SessionStore(None, SessionLimits(64, 64, 4, 3600), None)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def serve():
        app = Endpoint(store, CompletionBatcher(lambda c, s: [], 8), None, "run-token", "policy", 8).app()
        return HttpServer(app, "127.0.0.1", 0, role="actor", name="endpoint")

    server = asyncio.run_coroutine_threadsafe(serve(), loop).result()
    yield store, f"http://127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)


def items(store, url, cases: list[tuple[str, dict]]) -> list[AgentItem]:
    ids = [f"a{i}" for i in range(len(cases))]
    keys = store.open(ids, SamplingParams())
    return [AgentItem(f"{url}/sessions/{sid}/v1", key, prompt, "gt", extra)
            for sid, key, (prompt, extra) in zip(ids, keys, cases)]


def test_each_agent_s_outcome_is_its_own(endpoint, tmp_path):
    store, url = endpoint
    (tmp_path / "agents.py").write_text(textwrap.dedent(AGENTS))
    agents = Agents(AgentSection(path=f"{tmp_path}/agents.py:agent", workers=1, concurrency=8, timeout_s=2.0))
    try:
        cases = [("models", {}), ("raise", {}), ("hang", {}), ("text", {}), ("ok", {"value": 0.75})]
        outcomes = agents.run(items(store, url, cases))
        assert outcomes[0].reward == 1.0 and not outcomes[0].error
        assert "ValueError: no luck" in outcomes[1].error
        assert "timed out after 2 s (reward.agent.timeout_s)" in outcomes[2].error
        assert outcomes[3].error == "returned 'not a number', not a number"
        assert outcomes[4].reward == 0.75 and not outcomes[4].error
        # The worker lived through all of it: the next call is answered by it.
        assert agents.run(items(store, url, [("ok", {"value": 2})]))[0].reward == 2.0
        # A key of another session is refused (404): an agent reaches its own session alone.
        [item] = items(store, url, [("models", {})])
        stolen = AgentItem(item.base_url.replace("/a0/", "/a1/"), item.key, "models", "gt")
        assert "404" in agents.run([stolen])[0].error
    finally:
        agents.close()


def test_an_agent_that_is_no_async_def_or_cannot_load_is_named(endpoint, tmp_path):
    store, url = endpoint
    (tmp_path / "agents.py").write_text(textwrap.dedent(AGENTS))
    agents = Agents(AgentSection(path=f"{tmp_path}/agents.py:not_async", workers=1))
    try:
        assert "must name an `async def`" in agents.run(items(store, url, [("ok", {})]))[0].error
    finally:
        agents.close()
    with pytest.raises(ConfigError, match="reward.agent.path: cannot load the agent"):
        Agents(AgentSection(path=f"{tmp_path}/agents.py:missing", workers=1))


def test_a_reward_role_without_an_agent_refuses_to_run_one():
    from rolefleet.common.config import parse_config

    core = RewardCore(parse_config({"model": {"model_name_or_path": "m"}}).reward)
    try:
        with pytest.raises(FailedPrecondition, match="reward.agent.path"):
            core.run_agents([AgentItem("http://x/v1", "k", "p", "g")])
    finally:
        core.close()

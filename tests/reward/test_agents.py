"""Agent code run by the reward role (`reward/agents.py`, the sandbox's `agents` op), against a real
endpoint on loopback: each agent gets an `openai` client of its own session (its key, its base URL),
its session starts from nothing, and an agent that raises, hangs past its deadline or returns no
number costs its own episode alone."""

from __future__ import annotations

import textwrap

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
from tests.helpers import scripted_chat_endpoint, served_on_loopback

pytestmark = pytest.mark.procs

AGENTS = '''
import asyncio
import os

live = 0

async def agent(client, prompt, ground_truth, extra):
    global live
    if prompt == "where":  # its worker's pid, and how many agents of its worker run beside it
        live += 1
        await asyncio.sleep(0.3)
        beside = live
        await asyncio.sleep(0.3)
        live -= 1
        return float(os.getpid() * 1000 + beside)
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
    app = Endpoint(store, CompletionBatcher(lambda c, s: [], 8), None, "run-token", "policy", 8).app()
    with served_on_loopback(app) as url:
        yield store, url


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


@pytest.mark.parametrize("concurrency", [64, 2])
def test_a_call_s_episodes_spread_over_every_worker_each_running_at_most_its_concurrency(endpoint, tmp_path, concurrency):
    """A worker's loop runs its agents' clients one after another: 12 episodes on 3 workers are 4 on
    each, not 12 on one, and never more at once on one than `concurrency` (at 2: six parts of 2, on
    every worker, each taking the next part as it is free, so which worker ran how many is timing)."""
    store, url = endpoint
    (tmp_path / "agents.py").write_text(textwrap.dedent(AGENTS))
    agents = Agents(AgentSection(path=f"{tmp_path}/agents.py:agent", workers=3, concurrency=concurrency, timeout_s=20.0))
    try:
        outcomes = agents.run(items(store, url, [("where", {})] * 12))
        assert not [o.error for o in outcomes if o.error]
        by_worker: dict[int, list[int]] = {}
        for o in outcomes:
            pid, beside = divmod(int(o.reward), 1000)
            by_worker.setdefault(pid, []).append(beside)
        if concurrency >= 4:
            assert sorted(len(b) for b in by_worker.values()) == [4, 4, 4]
        else:
            assert len(by_worker) == 3 and all(len(b) % concurrency == 0 for b in by_worker.values())
        assert max(max(b) for b in by_worker.values()) == min(4, concurrency)
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


GUESS = '''
import asyncio

LOG = {log!r}


def note(line):
    with open(LOG, "a") as f:
        f.write(line + "\\n")


class Guess:
    """Guess a secret number: state kept across the episode's turns (the secret, the attempts)."""

    def __init__(self, hint="higher"):
        self.hint, self.attempts, self.secret = hint, 0, None

    def reset(self, prompt, ground_truth, extra):
        self.secret = extra["secret"]
        note(f"reset {{self.secret}}")
        return [{{"role": "user", "content": "Guess my number."}}]

    async def step(self, message):
        self.attempts += 1
        if self.secret == "slow":
            await asyncio.sleep(60)
        if self.secret == "broken":
            raise RuntimeError("the environment broke")
        guess = int(message["content"])
        if guess == self.secret:
            return {{"observation": [], "done": True, "reward": 1.0 / self.attempts}}
        return {{"observation": self.hint if guess < self.secret else "lower", "done": False, "reward": 0.0}}

    def close(self):
        note(f"close {{self.secret}} after {{self.attempts}}")
'''


@pytest.fixture(scope="module")
def chat_endpoint(chat_model_dir):
    """An endpoint on loopback whose 'policy' answers 3, 5, 7, ... on its 1st, 2nd, 3rd turn."""
    with scripted_chat_endpoint(chat_model_dir, lambda turn: str(2 * turn + 1), 4, 512) as served:
        yield served


def test_a_stateful_environment_lives_for_its_episode_and_is_closed_however_it_ends(chat_endpoint, tmp_path):
    store, url = chat_endpoint
    log = tmp_path / "env.log"
    (tmp_path / "guess.py").write_text(textwrap.dedent(GUESS.format(log=str(log))))
    agents = Agents(AgentSection(path=f"{tmp_path}/guess.py:Guess", workers=1, timeout_s=3.0,
                                 options={"hint": "higher!"}))
    try:
        cases = [("", {"secret": 5}), ("", {"secret": 3}), ("", {"secret": 99}), ("", {"secret": "broken"}),
                 ("", {"secret": "slow"})]
        ids = [f"g{i}" for i in range(len(cases))]
        keys = store.open(ids, SamplingParams(max_new_tokens=8))
        outcomes = agents.run([AgentItem(f"{url}/sessions/{sid}/v1", key, prompt, "gt", extra)
                               for sid, key, (prompt, extra) in zip(ids, keys, cases)])
        trajectories = store.close(ids)
    finally:
        agents.close()
    # 5: guessed on the 2nd turn (3, then 5), its state (the attempts) kept between the turns.
    assert outcomes[0].reward == 0.5 and trajectories[0].turns == 2
    assert outcomes[1].reward == 1.0 and trajectories[1].turns == 1
    # 99: never guessed; the session's turns (4) run out and the episode ends there, rewarded 0.
    assert outcomes[2].reward == 0.0 and not outcomes[2].error and trajectories[2].turns == 4
    assert "RuntimeError: the environment broke" in outcomes[3].error
    assert "timed out after 3 s" in outcomes[4].error
    lines = sorted(log.read_text().splitlines())
    # Each environment was made, reset and closed once, the failed and the timed-out too.
    assert [line for line in lines if line.startswith("close")] == [
        "close 3 after 1", "close 5 after 2", "close 99 after 4", "close broken after 1", "close slow after 1"]
    assert len([line for line in lines if line.startswith("reset")]) == 5
    # The environment's observation (with its option) is what the model read before its next turn.
    assert "higher!" in store.tokenizer.decode(trajectories[0].response_ids.tolist())


TWO_TURNS = '''
async def agent(client, prompt, ground_truth, extra):
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    return 1.0
'''


def test_a_repeated_call_of_the_same_episodes_starts_each_session_over_without_a_request_of_its_own(
        chat_endpoint, tmp_path):
    """The reward role restarted mid-call and the coordinator sends the same episodes again: their
    sessions hold the first call's turns, and the agents begin from the prompt. Each request carries
    its call's `X-Episode-Attempt`, so a session starts over at the new call's first request."""
    store, url = chat_endpoint
    (tmp_path / "two.py").write_text(textwrap.dedent(TWO_TURNS))
    agents = Agents(AgentSection(path=f"{tmp_path}/two.py:agent", workers=1, timeout_s=5.0))
    seen = []
    real = store.begin
    store.begin = lambda *a, **k: (seen.append(k.get("attempt", a[5] if len(a) > 5 else None)), real(*a, **k))[1]
    try:
        ids = ["r0", "r1"]
        keys = store.open(ids, SamplingParams(max_new_tokens=8))
        items_ = [AgentItem(f"{url}/sessions/{sid}/v1", key, "hello", "gt") for sid, key in zip(ids, keys)]
        assert [o.reward for o in agents.run(items_)] == [1.0, 1.0]
        assert [o.reward for o in agents.run(items_)] == [1.0, 1.0]  # the repeat: no 409
        trajectories = store.close(ids)
    finally:
        store.begin = real
        agents.close()
    # Two turns each, not four: the repeat replaced the first call's conversation.
    assert [t.turns for t in trajectories] == [2, 2]
    # Every request said which call it came from: one value per call, two calls.
    assert len(seen) == 8 and None not in seen and len(set(seen[:4])) == 1 and len(set(seen)) == 2


@pytest.mark.parametrize("mutual,server_name", [(False, None), (True, None), (True, "actor")],
                         ids=["tls", "mutual-tls", "server-name"])
def test_agents_reach_an_endpoint_over_the_run_s_tls(tmp_path, mutual, server_name):
    """With `security.tls` on the actor's endpoint is https with the run's certificates: the agents'
    clients verify it with the run's CA (and present the reward role's certificate under mutual TLS);
    without them the episode fails on the certificate, naming it. With `server_name` the endpoint is
    dialled at an address its certificate does not name (127.0.0.2): the clients check the name
    instead, and without it fail on the certificate, as they would without the run's CA."""
    import asyncio
    import threading

    from rolefleet.certs import make_certs
    from rolefleet.common.config import TlsSection
    from rolefleet.rpc.http_server import HttpServer

    make_certs(tmp_path / "tls")
    tls = TlsSection(cert_file=str(tmp_path / "tls" / "{role}.pem"), key_file=str(tmp_path / "tls" / "{role}-key.pem"),
                     ca_file=str(tmp_path / "tls" / "ca.pem"), mutual=mutual, server_name=server_name)
    host = "127.0.0.2" if server_name else "127.0.0.1"  # the certificates name 127.0.0.1, localhost and the role
    store = SessionStore(None, SessionLimits(64, 64, 4, 3600), None)
    app = Endpoint(store, CompletionBatcher(lambda c, s: [], 8), None, "run-token", "policy", 8).app()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def serve():
        return HttpServer(app, host, 0, tls, role="actor", name="endpoint")

    server = asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    (tmp_path / "agents.py").write_text(textwrap.dedent(AGENTS))
    ours = Agents(AgentSection(path=f"{tmp_path}/agents.py:agent", workers=1, timeout_s=5.0), tls)
    # Without the run's CA; or, where the name is what counts, with everything but the name.
    plain = Agents(AgentSection(path=f"{tmp_path}/agents.py:agent", workers=1, timeout_s=5.0),
                   tls.model_copy(update={"server_name": None}) if server_name else None)
    try:
        url = f"https://{host}:{server.port}"
        assert ours.run(items(store, url, [("models", {})]))[0].reward == 1.0  # its own session's /models
        [refused] = plain.run(items(store, url, [("models", {})]))
        assert "Connection error" in refused.error and "CERTIFICATE_VERIFY_FAILED" in refused.error, refused.error
    finally:
        ours.close()
        plain.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)

"""The agent workers' transport (`reward/batching.py`) against a real endpoint on loopback: a turn's
session completions of many `openai` clients travel as one batch request and each client gets its
own answer; what is not a session completion, or a batch the endpoint does not take, goes out as it
came; a batch that cannot be sent fails each of its requests."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from starlette.responses import JSONResponse

from rolefleet.actor.types import SamplingParams
from rolefleet.reward import batching
from rolefleet.reward.batching import BATCH_PATH, batching_transport, openai_http_library
from tests.helpers import scripted_chat_endpoint

pytestmark = pytest.mark.multiturn
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


class Seen:
    """An ASGI app in front of the endpoint's: the paths it was asked, (`refuse`) a 404 for batches,
    and (`prefix`) the endpoint under a path prefix, as a proxy would serve it."""

    def __init__(self, refuse: bool = False, prefix: str = ""):
        self.paths: list[str] = []
        self.refuse, self.prefix = refuse, prefix

    def __call__(self, app):
        async def seen(scope, receive, send):
            if scope["type"] == "http":
                self.paths.append(scope["path"])
                if not scope["path"].startswith(self.prefix):
                    return await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)
                scope = {**scope, "path": scope["path"][len(self.prefix):]}
                if self.refuse and scope["path"] == BATCH_PATH:
                    return await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)
            await app(scope, receive, send)

        return seen


def clients(store, url: str, n: int) -> tuple[list[openai.AsyncOpenAI], object]:
    """n sessions' clients over one batching transport, as an agent worker gives its agents."""
    lib = openai_http_library()
    http = openai.DefaultAsyncHttpxClient(transport=batching_transport(lib, lib.AsyncHTTPTransport()), timeout=30)
    ids = [f"t{i}" for i in range(n)]
    keys = store.open(ids, SamplingParams(max_new_tokens=8))
    return [openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key=key, http_client=http, max_retries=0)
            for sid, key in zip(ids, keys)], http


async def two_turns(client: openai.AsyncOpenAI, start: asyncio.Barrier) -> list[str]:
    # A client's first request waits on a thread (its platform headers), then the turns begin together.
    assert [m.id async for m in client.models.list()] == ["policy"]
    await start.wait()
    messages = list(QUESTION)
    said = []
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        said.append(reply.choices[0].message.content)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    return said


@pytest.mark.parametrize("refuse, prefix", [(False, ""), (True, ""), (False, "/actor")],
                         ids=["batched", "endpoint-without-batches", "behind-a-path-prefix"])
def test_each_client_gets_its_own_answers_and_a_turn_s_requests_travel_together(chat_model_dir, refuse, prefix,
                                                                                monkeypatch):
    # A wider window than the transport's milliseconds: on a loaded machine (the suite's three
    # processes on two cores) twelve clients' requests can come further apart than 2 ms, and the
    # turn then travels in several batches (5 for 24 requests, seen). What is checked is the
    # grouping: every request that joins while the batch is held goes with it.
    monkeypatch.setattr(batching, "QUIET_S", 0.25)
    monkeypatch.setattr(batching, "MAX_WAIT_S", 2.0)
    seen = Seen(refuse, prefix)
    with scripted_chat_endpoint(chat_model_dir, lambda n: f"answer {n}", max_turns=4, wrap=seen) as (store, url):
        agents, http = clients(store, url + prefix, 12)

        async def run():
            start = asyncio.Barrier(len(agents))  # the turns begin once every client is ready
            try:
                return await asyncio.gather(*(two_turns(c, start) for c in agents))
            finally:
                await http.aclose()

        said = asyncio.run(run())
        assert said == [["answer 1", "answer 2"]] * 12  # each session's own turns
        trajectories = store.close([f"t{i}" for i in range(12)])
        assert [t.turns for t in trajectories] == [2] * 12  # every request was recorded in its own session
    turns = [p for p in seen.paths if not p.endswith("/models")]
    session_paths = [p for p in turns if p != prefix + BATCH_PATH]
    if refuse:  # the first batch refused, then one by one
        assert turns.count(BATCH_PATH) == 1 and len(session_paths) == 24
    else:  # one batch a turn: the two turns' 24 requests in 2 HTTP requests
        assert turns == [prefix + BATCH_PATH] * 2


def test_streams_and_other_routes_go_out_as_they_came(chat_model_dir):
    seen = Seen()
    with scripted_chat_endpoint(chat_model_dir, lambda n: "streamed", max_turns=4, wrap=seen) as (store, url):
        [agent], http = clients(store, url, 1)

        async def run():
            try:
                models = [m.id async for m in agent.models.list()]
                stream = await agent.chat.completions.create(model="policy", messages=QUESTION, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                return models, text
            finally:
                await http.aclose()

        assert asyncio.run(run()) == (["policy"], "streamed")
        store.close(["t0"])
    assert seen.paths == ["/sessions/t0/v1/models", "/sessions/t0/v1/chat/completions"]


def test_a_batch_that_cannot_be_sent_fails_each_of_its_requests(chat_model_dir):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with scripted_chat_endpoint(chat_model_dir, lambda n: "x", max_turns=4) as (store, _):
        agents, http = clients(store, f"http://127.0.0.1:{port}", 3)

        async def run():
            try:
                return await asyncio.gather(*(c.chat.completions.create(model="policy", messages=QUESTION)
                                              for c in agents), return_exceptions=True)
            finally:
                await http.aclose()

        outcomes = asyncio.run(run())
        store.close([f"t{i}" for i in range(3)])
    assert all(isinstance(o, openai.APIConnectionError) for o in outcomes), outcomes

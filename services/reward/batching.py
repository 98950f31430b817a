"""The agent workers' requests to the actor's endpoint, a turn's worth in one HTTP request.

A step's agents ask for their turns all at once, and the actor's endpoint answers them on one event
loop while the rollout engine waits: each request costs that loop its HTTP parsing, its connection's
callbacks and its answer's writes (about half of its time a request, `benchmarks/endpoint_turns.py`)
beside the work that is the request's own (the body validated, the new messages rendered). An
agent worker runs its agents on one loop too, so their requests of a turn come out of it together:
`BatchingTransport` (the HTTP transport of every agent's `openai` client in the worker) holds each
session completion until no other joins it for a moment, then sends those it holds as
one `POST /v1/batch/chat/completions`, whose every item the endpoint answers exactly as it would the
request alone (the same checks, errors and records), and hands each agent its own answer as an
HTTP response. The agent code sees its client as it was: nothing but the transport changed.

Everything else (other routes, streamed completions, a request whose body is not JSON) goes out as
it came; so does a batch the endpoint does not take (a batch past its size limit: its requests are
then sent one by one; an endpoint without the route: every request from then on). A batch that
fails on the way (the connection) fails each of its requests with that error, as it would have
failed them one by one.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from dataclasses import dataclass
from typing import Any

BATCH_PATH = "/v1/batch/chat/completions"
# A session's completions, under whatever prefix the endpoint is reached at (a proxy's path).
SESSION_CHAT = re.compile(r"(?P<prefix>.*)(?P<path>/sessions/[^/]+/v1/chat/completions)")
# The headers of a session completion the endpoint reads (its key, the agent runner's attempt, the body's type).
FORWARDED = ("authorization", "x-episode-attempt", "content-type")
# A batch goes out as soon as it holds FLUSH_AT requests: the worker's agents read their answers
# and ask again one after another, and the endpoint parses a first part while they make the rest.
FLUSH_AT = 16
MAX_ITEMS = 256  # the endpoint's own bound is 1024 (actor/openai_api.py)
MAX_BYTES = 8 << 20  # well within the endpoint's body limit
# A batch goes out once no request joined it for QUIET_S (the agents that were ready have all
# asked), and no later than MAX_WAIT_S after its first: a few milliseconds against the endpoint's
# own gathering of a turn's requests, which waits for all of them.
QUIET_S = 0.002
MAX_WAIT_S = 0.010


@dataclass
class _Held:
    request: Any
    prefix: str  # the endpoint's, before /sessions/...
    path: str  # the route's path, /sessions/<id>/v1/chat/completions
    body: str
    answer: asyncio.Future


def openai_http_library() -> Any:
    """The HTTP library (its module) of the installed `openai` client's own HTTP client."""
    import openai

    return importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])


def batching_transport(http_library: Any, inner: Any) -> Any:
    """A transport of `http_library` (the HTTP library of the `openai` client) over `inner`."""

    class BatchingTransport(http_library.AsyncBaseTransport):
        def __init__(self):
            self._held: list[_Held] = []
            self._flush: asyncio.TimerHandle | None = None
            self._seen = 0  # requests held so far: a flush waits while this grows
            self._first_held = 0.0
            self._sending: set[asyncio.Task] = set()
            self._one_by_one = False  # the endpoint has no batch route: every request goes out alone

        async def handle_async_request(self, request: Any) -> Any:
            route = None if self._one_by_one else _batchable(request)
            if route is None:
                return await inner.handle_async_request(request)
            held = _Held(request, *route, asyncio.get_running_loop().create_future())
            self._held.append(held)
            self._seen += 1
            if len(self._held) >= FLUSH_AT:
                self._send_held()
            elif self._flush is None:
                loop = asyncio.get_running_loop()
                self._first_held = loop.time()
                self._flush = loop.call_later(QUIET_S, self._settle, self._seen)
            return await held.answer

        async def aclose(self) -> None:
            await asyncio.gather(*self._sending, return_exceptions=True)
            await inner.aclose()

        def _settle(self, seen: int) -> None:
            loop = asyncio.get_running_loop()
            if self._seen > seen and loop.time() - self._first_held < MAX_WAIT_S:
                self._flush = loop.call_later(QUIET_S, self._settle, self._seen)
                return
            self._flush = None
            self._send_held()

        def _send_held(self) -> None:
            held, self._held = self._held, []
            for part in _parts(held):
                task = asyncio.create_task(self._send(part))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

        async def _send(self, part: list[_Held]) -> None:
            first = part[0].request
            url = first.url.copy_with(path=part[0].prefix + BATCH_PATH, query=None)
            payload = json.dumps({"requests": [
                {"path": h.path, "body": h.body,
                 "headers": {k: h.request.headers[k] for k in FORWARDED if k in h.request.headers}}
                for h in part]}).encode()
            batch = http_library.Request("POST", url, content=payload, extensions=first.extensions,
                                         headers={"content-type": "application/json"})
            try:
                response = await inner.handle_async_request(batch)
                content = await response.aread()
                await response.aclose()
                answers = json.loads(content)["responses"] if response.status_code == 200 else None
                self._one_by_one = self._one_by_one or response.status_code in (404, 405)
                if answers is not None and len(answers) != len(part):
                    raise ValueError(f"the endpoint answered {len(answers)} of a batch of {len(part)}")
            except Exception as exc:  # noqa: BLE001 - each request fails with what failed its batch
                for h in part:
                    if not h.answer.done():
                        h.answer.set_exception(exc)
                return
            if answers is None:  # the endpoint took no batch: each request on its own
                await asyncio.gather(*(self._alone(h) for h in part))
                return
            for h, a in zip(part, answers):
                if not h.answer.done():
                    h.answer.set_result(http_library.Response(
                        a["status"], headers={**a.get("headers", {}), "content-type": "application/json"},
                        content=json.dumps(a["body"]).encode(), request=h.request))

        async def _alone(self, h: _Held) -> None:
            try:
                response = await inner.handle_async_request(h.request)
            except Exception as exc:  # noqa: BLE001 - the request's own failure
                if not h.answer.done():
                    h.answer.set_exception(exc)
                return
            if not h.answer.done():  # its agent may have given up meanwhile (its deadline)
                h.answer.set_result(response)

    return BatchingTransport()


def _batchable(request: Any) -> tuple[str, str, str] | None:
    """A session completion that is not streamed: its endpoint's prefix, route path and JSON body;
    else None (sent as it is)."""
    match = SESSION_CHAT.fullmatch(request.url.path) if request.method == "POST" else None
    if match is None:
        return None
    try:
        body = request.content.decode()
        parsed = json.loads(body)
    except Exception:  # noqa: BLE001 - a body not read yet, not text or not JSON: the endpoint says what is wrong
        return None
    return (match["prefix"], match["path"], body) if isinstance(parsed, dict) and not parsed.get("stream") else None


def _parts(held: list[_Held]) -> list[list[_Held]]:
    """`held` in batches to one endpoint each (an agent may have clients of several), within the bounds."""
    by_origin: dict[tuple, list[_Held]] = {}
    for h in held:
        url = h.request.url
        by_origin.setdefault((url.scheme, url.host, url.port, h.prefix), []).append(h)
    parts: list[list[_Held]] = []
    for same in by_origin.values():
        size = 0
        for k, h in enumerate(same):
            if k == 0 or len(parts[-1]) >= MAX_ITEMS or size + len(h.body) > MAX_BYTES:
                parts.append([])
                size = 0
            parts[-1].append(h)
            size += len(h.body)
    return parts

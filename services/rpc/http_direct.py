"""One hot route of a FastAPI app served straight from ASGI, past the framework's per-request layers.

The actor's OpenAI-compatible endpoint answers hundreds of agents' requests a step on one event
loop, the rollout engine waiting meanwhile: its session completions are the step's critical path.
Through FastAPI each request also goes through the middleware stack, the router and the dependency
solver (the bearer, headers and body resolved and validated field by field), about 40% of the
loop's time a request on the CPU (`benchmarks/endpoint_turns.py`, docs/benchmarks.md). `DirectRoutes`
answers the routes it is given itself: the body read (bounded), then the route's handler, which
parses it in one pass (pydantic's JSON validation) and returns the same responses the app's own
route would. Every other request goes to the app, whose route of the same path stays its OpenAPI
schema (and what `schemathesis` fuzzes both through).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

# A handler: (the path's match, the request's headers lowercased, its body) -> the response.
Handler = Callable[[re.Match, dict[str, str], bytes], Awaitable[Response]]


class BodyTooLarge(Exception):
    pass


@dataclass(frozen=True)
class DirectRoute:
    method: str
    path: re.Pattern
    handle: Handler


class DirectRoutes:
    """ASGI: `routes` answered here, everything else by `app` (its attributes too, e.g. `openapi`)."""

    def __init__(self, app: ASGIApp, routes: list[DirectRoute], max_body_bytes: int,
                 too_large: Callable[[int], Response]):
        self.app, self.routes, self.max_body_bytes, self.too_large = app, routes, max_body_bytes, too_large

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, match = self._route(scope)
        if route is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            body = await self._body(receive, headers)
        except BodyTooLarge:
            return await self.too_large(self.max_body_bytes)(scope, receive, send)
        response = await route.handle(match, headers, body)
        await response(scope, receive, send)

    def _route(self, scope: Scope) -> tuple[DirectRoute | None, re.Match | None]:
        if scope["type"] != "http":
            return None, None
        for route in self.routes:
            if scope["method"] == route.method and (match := route.path.fullmatch(scope["path"])):
                return route, match
        return None, None

    async def _body(self, receive: Receive, headers: dict[str, str]) -> bytes:
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def json_response(result: Any) -> Response:
    """What a FastAPI route's return becomes: a Response as it is, anything else as JSON."""
    return result if isinstance(result, Response) else JSONResponse(result)

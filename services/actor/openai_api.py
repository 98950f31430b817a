"""The actor's OpenAI-compatible Chat Completions endpoint (FastAPI, served by uvicorn in the actor
server's loop; docs/environments.md, "Your own agent").

Agent code written against the `openai` client drives an episode through its session's base URL,
`<url>/sessions/<id>/v1`, with the session's key as its api_key (the coordinator opens the
sessions and hands each agent its own: agent code never holds the run's token). The same routes
under `/v1` answer requests outside any session (the run's token; nothing is recorded), or a
session named in the `X-Session-Id` header.

Errors are OpenAI error objects: 400 naming the field, 401 without a valid key, 404 for an unknown
session, 409 for messages that do not extend the session's conversation (or a request while
another of the session is in flight), 429 past a session's limits, 503 while the actor cannot
generate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rolefleet.actor.completions import CompletionBatcher
from rolefleet.actor.sessions import Conflict, Session, SessionStore, UnknownSession, reply_message
from rolefleet.actor.types import FinishReason, Sample, SamplingParams
from rolefleet.common import metrics
from rolefleet.common.config import MIN_TEMPERATURE
from rolefleet.common.errors import FailedPrecondition, InvalidArgument, LimitExceeded, Unavailable
from rolefleet.rpc.http_direct import DirectRoute, DirectRoutes, json_response
from rolefleet.rpc.http_server import HttpServer

log = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"
ATTEMPT_HEADER = "X-Episode-Attempt"  # set by the reward role's agent runner: one value per call of its (sessions.begin)
ATTEMPT_MAX_CHARS = 64
MAX_BODY_BYTES = 32 << 20  # a request's body (4096 messages of a long conversation fit): 413 past it
MAX_N = 16
MAX_BATCH = 1024  # requests of one batch (reward/batching.py sends at most 256)
BATCH_PATH = "/v1/batch/chat/completions"
SESSION_CHAT = re.compile(r"/sessions/([^/]+)/v1/chat/completions")


class ToolFunction(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallMessage(BaseModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    """A chat message: its role and text (or text parts), and the tool-call fields. Other fields an
    OpenAI client writes (refusal, audio, annotations) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64)
    content: Optional[Union[str, list[TextPart]]] = None
    tool_calls: Optional[list[ToolCallMessage]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None


class ChatRequest(BaseModel):
    """The Chat Completions request. Fields an OpenAI client may send and that do not change what is
    sampled (user, metadata, store, ...) are accepted and ignored; those that would (penalties, logit
    bias, forced tool choice) are refused when set, never silently dropped."""

    model_config = ConfigDict(extra="allow")
    model: str = Field("policy", description="ignored: the policy answers")
    messages: list[Message] = Field(min_length=1, max_length=4096)
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["auto", "none"], dict[str, Any], str]] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=0, description="only 0: the sampled token's logprob")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    frequency_penalty: Optional[float] = Field(None, ge=0, le=0, description="only 0")
    presence_penalty: Optional[float] = Field(None, ge=0, le=0, description="only 0")
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=0, description="not supported")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERRORS = {status: {"model": ErrorBody, "description": why} for status, why in (
    (400, "a malformed request: `param` names the field"), (401, "no valid key (the session's, or the run's token)"),
    (404, "no such session open"), (409, "messages that do not extend the session's conversation, or a request while "
                                    "another of the session is in flight"),
    (413, "a body over the endpoint's bound"), (429, "past a session's limits"), (503, "the actor cannot generate now"))}
# `stream: true` answers server-sent events (chat.completion.chunk objects, then [DONE]).
STREAMED = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": {}}},
                  "description": "a chat.completion, or with `stream` its chunks as server-sent events"}}
BEARER = HTTPBearer(auto_error=False, description="a session's key, or the run's token")
Credentials = Annotated[Optional[HTTPAuthorizationCredentials], Depends(BEARER)]
SessionHeader = Annotated[Optional[str], Header(alias=SESSION_HEADER, description="the session a request under /v1 "
                                                 "acts in (instead of the session's base URL)")]
AttemptHeader = Annotated[Optional[str], Header(
    alias=ATTEMPT_HEADER, max_length=ATTEMPT_MAX_CHARS, description="the agent runner's call the request belongs to: a request of "
    "another call than the session's earlier ones starts its episode over (a repeated call begins from nothing)")]


class BatchItem(BaseModel):
    path: str = Field(description="the request's path: a session's completions, /sessions/<id>/v1/chat/completions")
    headers: dict[str, str] = Field(default_factory=dict, description="the request's headers that route reads "
                                    "(authorization, x-episode-attempt, content-type)")
    body: str = Field(description="the request's JSON body, as text")


class BatchRequest(BaseModel):
    requests: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH)


class Reward(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    reward: float = Field(description="the episode's reward (finite)")


def error_body(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    metrics.ENDPOINT_REQUESTS.labels("actor", str(status)).inc()
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status,
                        headers=headers)


class Endpoint:
    """The routes over a session store and a batcher of the rollout engine's calls."""

    def __init__(self, store: SessionStore, batcher: CompletionBatcher, tokenizer: Any, token: str | None,
                 model_name: str, max_new_tokens: int):
        self.store, self.batcher, self.tokenizer = store, batcher, tokenizer
        self.token, self.model_name, self.max_new_tokens = token, model_name, max_new_tokens

    def app(self) -> DirectRoutes:
        """The ASGI app: the FastAPI app of the routes below, its session completions served directly."""
        app = FastAPI(title="RoleFleet actor: OpenAI-compatible chat completions", version="1",
                      max_body_size=MAX_BODY_BYTES)
        app.add_exception_handler(RequestValidationError, _invalid_request)
        app.add_exception_handler(StarletteHTTPException, lambda request, exc: error_body(
            exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))
        router = APIRouter(responses=ERRORS)
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], responses=STREAMED)
        router.add_api_route("/sessions/{session_id}/v1/models", self.session_models, methods=["GET"])
        router.add_api_route("/sessions/{session_id}/v1/chat/completions", self.session_chat, methods=["POST"],
                             responses=STREAMED)
        router.add_api_route("/sessions/{session_id}/v1/reset", self.reset, methods=["POST"])
        router.add_api_route(BATCH_PATH, self.batch, methods=["POST"])
        router.add_api_route("/v1/episodes", self.claim, methods=["POST"])
        router.add_api_route("/v1/episodes/{session_id}/reward", self.post_reward, methods=["POST"])
        app.include_router(router)
        # The hot routes served directly (rpc/http_direct.py); the app's routes above stay their schema.
        direct = [DirectRoute("POST", SESSION_CHAT, self._direct_session_chat),
                  DirectRoute("POST", re.compile(re.escape(BATCH_PATH)), self._direct_batch)]
        return DirectRoutes(app, direct, MAX_BODY_BYTES, lambda limit: error_body(
            413, f"the request's body exceeds {limit} bytes"))

    async def caller(self, session_id: Optional[str], x_session_id: Optional[str],
                     credentials: Optional[HTTPAuthorizationCredentials]) -> Optional[Session]:
        """The session a request acts in (None: outside any), from its bearer: a session's own key,
        or the run's token."""
        bearer = credentials.credentials if credentials is not None else None
        run_token = self.token is None or (bearer is not None and secrets.compare_digest(bearer, self.token))
        sid = session_id or x_session_id
        if sid is None:
            if not run_token:
                raise _Refused(401, "requests outside a session need `Authorization: Bearer <the run's token>`")
            return None
        if bearer is None and not run_token:
            raise _Refused(401, "a session's requests need `Authorization: Bearer <its key>`")
        return self.store.session(sid, None if run_token else bearer)

    async def claim(self, request: Request, credentials: Credentials = None):
        """An episode waiting for an agent outside the cluster (reward.agent.external): its session's
        base URL and key, and its task. 404 while none waits (ask again)."""
        try:
            await self.caller(None, None, credentials)
        except _Refused as exc:
            return _error_of(exc)
        s = self.store.claim()
        if s is None:
            return error_body(404, "no episode is waiting to be claimed (the run opens a step's episodes as it "
                                   "begins the step): ask again")
        return {"id": s.id, "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{s.id}/v1", "key": s.key,
                "prompt": s.task.prompt, "ground_truth": s.task.ground_truth, "extra": s.task.extra}

    async def post_reward(self, session_id: str, body: Reward, credentials: Credentials = None):
        """The reward of a claimed episode, once its agent outside the cluster drove it to its end."""
        try:
            session = await self.caller(session_id, None, credentials)
            self.store.post_reward(session, body.reward)
        except (_Refused, UnknownSession, Conflict) as exc:
            return _error_of(exc)
        return {"id": session_id, "reward": body.reward}

    async def reset(self, session_id: str, credentials: Credentials = None):
        """The session's episode starts over (an agent outside the cluster that begins again; the
        reward role's agent runner says so with `X-Episode-Attempt` instead, no request of its own)."""
        try:
            session = await self.caller(session_id, None, credentials)
            self.store.reset(session)
        except (_Refused, UnknownSession, Conflict) as exc:
            return _error_of(exc)
        return {"object": "session", "id": session_id, "turns": 0}

    async def models(self, x_session_id: SessionHeader = None, credentials: Credentials = None):
        try:
            await self.caller(None, x_session_id, credentials)
        except (_Refused, UnknownSession) as exc:
            return _error_of(exc)
        return self._models()

    async def session_models(self, session_id: str, credentials: Credentials = None):
        try:
            await self.caller(session_id, None, credentials)
        except (_Refused, UnknownSession) as exc:
            return _error_of(exc)
        return self._models()

    def _models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "rolefleet"}]}

    async def chat(self, body: ChatRequest, x_session_id: SessionHeader = None, x_episode_attempt: AttemptHeader = None,
                   credentials: Credentials = None):
        """A completion outside any session, or in the one `X-Session-Id` names."""
        return await self._chat(body, None, x_session_id, credentials, x_episode_attempt)

    async def session_chat(self, session_id: str, body: ChatRequest, x_episode_attempt: AttemptHeader = None,
                           credentials: Credentials = None):
        """A completion of session `session_id` (the base URL its agent's client was given)."""
        return await self._chat(body, session_id, None, credentials, x_episode_attempt)

    async def batch(self, body: BatchRequest):
        """Session completions of many agents in one request (the reward role's agent workers send
        each turn's so: reward/batching.py): `responses` in the requests' order, each the status,
        headers and JSON body the request alone would have been answered with; none is streamed."""
        return await self._batch(body.requests)

    async def _direct_batch(self, match: re.Match, headers: dict[str, str], raw: bytes) -> Response:  # noqa: ARG002
        body = _parsed(BatchRequest, headers, raw)
        return body if isinstance(body, Response) else await self._batch(body.requests)

    async def _batch(self, items: list[BatchItem]) -> Response:
        # All at once: their completions reach the batcher together, as the requests alone would.
        answers = await asyncio.gather(*(self._batch_item(item) for item in items))
        return Response(b'{"responses":[' + b",".join(answers) + b"]}", media_type="application/json")

    async def _batch_item(self, item: BatchItem) -> bytes:
        match = SESSION_CHAT.fullmatch(item.path)
        if match is None:
            response = error_body(400, f"requests[].path: {item.path[:200]!r} is not a session's completions "
                                       "(/sessions/<id>/v1/chat/completions)", "path")
        else:
            response = await self._direct_session_chat(match, {k.lower(): v for k, v in item.headers.items()},
                                                       item.body.encode(), streamed=False)
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return b'{"status":%d,"headers":%s,"body":%s}' % (response.status_code, json.dumps(headers).encode(),
                                                          response.body)

    async def _direct_session_chat(self, match: re.Match, headers: dict[str, str], raw: bytes,
                                   streamed: bool = True) -> Response:
        """`session_chat` served directly: the same checks (the header, then the body, as FastAPI
        orders them) and the same answers. `streamed`: whether it may answer as a stream."""
        attempt = headers.get(ATTEMPT_HEADER.lower())
        if attempt is not None and len(attempt) > ATTEMPT_MAX_CHARS:
            return error_body(400, f"{ATTEMPT_HEADER}: String should have at most {ATTEMPT_MAX_CHARS} characters",
                              ATTEMPT_HEADER)
        body = _parsed(ChatRequest, headers, raw)
        if isinstance(body, Response):
            return body
        if body.stream and not streamed:
            return error_body(400, "stream: a batch's completions are answered whole; stream a request on its own",
                              "stream")
        try:
            return json_response(await self._chat(body, match.group(1), None, _bearer(headers.get("authorization")),
                                                  attempt))
        except Exception as exc:  # noqa: BLE001 - as the framework would: a 500, the loop serving on
            log.exception("the endpoint failed a request")
            return error_body(500, f"{type(exc).__name__}: {exc}")

    async def _chat(self, body: ChatRequest, session_id: Optional[str], x_session_id: Optional[str],
                    credentials: Optional[HTTPAuthorizationCredentials], attempt: Optional[str] = None):
        start = time.perf_counter()
        messages = [m.model_dump(exclude_unset=True) for m in body.messages]
        try:
            session = await self.caller(session_id, x_session_id, credentials)
            if session is not None and body.n != 1:
                raise InvalidArgument("n", f"a session is one conversation: n must be 1, got {body.n} (open n sessions)")
            turn = self.store.begin(session, messages, _tools(body), _max_tokens(body), self._sampling(body, session),
                                    attempt)
        except _Refused as r:
            return error_body(r.status, r.message)
        except (InvalidArgument, LimitExceeded, UnknownSession, Conflict, FailedPrecondition) as exc:
            return _error_of(exc)
        asked = time.perf_counter()
        try:
            samples = await self.batcher.complete(turn.context, turn.sampling, body.n)
        except BaseException as exc:  # the session is as it was; the agent reads why (a client gone: cancelled)
            self.store.release(turn)
            if not isinstance(exc, Exception):
                raise
            return _error_of(exc)
        answered = time.perf_counter()
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        choices = []
        for i, s in enumerate(samples):
            reply, calls = reply_message(s.response_text, parse_tools)
            if i == 0:
                self.store.record(turn, s, reply)
            choices.append(self._choice(i, s, reply, bool(calls), body.logprobs))
        completion = sum(len(s.response_ids) for s in samples)
        usage = {"prompt_tokens": len(turn.context), "completion_tokens": completion,
                 "total_tokens": len(turn.context) + completion}
        metrics.ENDPOINT_REQUESTS.labels("actor", "200").inc()
        self.batcher.stats.add(requests=1, handler_s=(asked - start) + (time.perf_counter() - answered))
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._events(ident, created, choices, usage if include_usage else None),
                                     media_type="text/event-stream")
        return {"id": ident, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage}

    def _sampling(self, body: ChatRequest, session: Session | None) -> SamplingParams:
        """A request outside a session samples as it asks; a session with the run's sampling (the
        trainer's recompute and importance weights assume it), whatever the request says."""
        stops = self._stop_ids(body.stop)
        if session is not None:
            return replace(session.sampling, stop_token_ids=tuple(sorted({*session.sampling.stop_token_ids, *stops})))
        temperature = 1.0 if body.temperature is None else body.temperature
        if 0 < temperature < MIN_TEMPERATURE:
            raise InvalidArgument("temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
        return SamplingParams(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                              max_new_tokens=self.max_new_tokens, seed=-1 if body.seed is None else body.seed,
                              stop_token_ids=tuple(stops), stop_at_end_of_turn=True)

    def _stop_ids(self, stop: str | list[str] | None) -> list[int]:
        """Stop strings as token ids: each must be one token of the tokenizer (the engines stop at
        ids; cutting text afterwards would return text that differs from the tokens trained)."""
        ids = []
        for i, text in enumerate([stop] if isinstance(stop, str) else stop or []):
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            if len(tokens) != 1:
                raise InvalidArgument(f"stop[{i}]", f"{text!r} is {len(tokens)} tokens of the policy's tokenizer; "
                                      "stop sequences must be single tokens")
            ids.append(tokens[0])
        return ids

    def _choice(self, index: int, s: Sample, reply: dict, called: bool, logprobs: bool) -> dict:
        finish = "tool_calls" if called else ("stop" if s.finish_reason == FinishReason.STOP else "length")
        choice: dict[str, Any] = {"index": index, "message": reply, "finish_reason": finish, "logprobs": None}
        if logprobs:
            tokens = self.tokenizer.convert_ids_to_tokens(s.response_ids.tolist())
            choice["logprobs"] = {"content": [
                {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8", "surrogatepass")), "top_logprobs": []}
                for t, lp in zip(tokens, s.logprobs.tolist())]}
        return choice

    async def _events(self, ident: str, created: int, choices: list[dict], usage: dict | None) -> AsyncIterator[str]:
        """The completion as server-sent events: each choice's whole message as one delta (the
        engine returns finished sequences), then its finish reason, the usage if asked, [DONE]."""
        head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        for c in choices:
            delta = {k: v for k, v in c["message"].items() if v is not None}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(delta["tool_calls"])]
            yield _event({**head, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None,
                                               "logprobs": c["logprobs"]}]})
            yield _event({**head, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
        if usage is not None:
            yield _event({**head, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _tools(body: ChatRequest) -> list[dict] | None:
    if body.tool_choice not in (None, "auto", "none"):
        raise InvalidArgument("tool_choice", "only auto and none: the policy chooses whether to call a tool")
    return [t.model_dump() for t in body.tools] if body.tools else None


def _max_tokens(body: ChatRequest) -> int | None:
    return body.max_completion_tokens or body.max_tokens


def _error_of(exc: BaseException) -> JSONResponse:
    if isinstance(exc, _Refused):
        return error_body(exc.status, exc.message)
    if isinstance(exc, InvalidArgument):
        return error_body(400, str(exc), exc.field)
    if isinstance(exc, UnknownSession):
        return error_body(404, str(exc))
    if isinstance(exc, Conflict):
        return error_body(409, str(exc))
    if isinstance(exc, LimitExceeded):
        return error_body(429, str(exc), exc.field)
    if isinstance(exc, (FailedPrecondition, Unavailable)):
        return error_body(503, str(exc))
    return error_body(500, f"{type(exc).__name__}: {exc}")


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _invalid(exc.errors())


def _invalid(errors: Sequence[Any], prefix: tuple = ()) -> JSONResponse:
    """400 naming the first error's field (`prefix`: where the errors' locations are relative to)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _field((*prefix, *first.get("loc", ())))
    return error_body(400, f"{param or 'body'}: {first.get('msg')}", param)


def _parsed(model: type[BaseModel], headers: dict[str, str], raw: bytes) -> Any:
    """A directly served route's JSON body as `model`, in one pass; or the 400 FastAPI would answer."""
    if not _json_content(headers.get("content-type")):
        return error_body(400, "body: Input should be a valid dictionary or object to extract fields from")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        return _invalid(exc.errors(), ("body",))


def _bearer(authorization: str | None) -> HTTPAuthorizationCredentials | None:
    """The `Authorization: Bearer <token>` credentials, as the app's HTTPBearer reads them (None
    without them)."""
    scheme, _, token = (authorization or "").partition(" ")
    if not token or scheme.lower() != "bearer":
        return None
    return HTTPAuthorizationCredentials(scheme=scheme, credentials=token)


def _json_content(content_type: str | None) -> bool:
    """A body FastAPI reads as JSON: no content type, or application/json or application/*+json."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _field(loc: tuple) -> str | None:
    """A validation error's location as the field's path (`messages[2].content`): list indexes in
    brackets, without the body's root or the union member pydantic tried (`str`, `list[...]`); a
    header by its name."""
    if len(loc) == 2 and loc[0] == "header":
        return str(loc[1])
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).isidentifier() and str(part) not in _TYPE_TAGS:
            out += f".{part}" if out else str(part)
        else:
            break
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def start_endpoint(core: Any, cfg: Any, tls: Any, token: str | None) -> HttpServer:
    """The endpoint of `core` (an ActorCore) served in this loop on actor.endpoint.host:port."""
    ep = cfg.actor.endpoint
    batcher = CompletionBatcher(lambda continuations, sampling: core.generate([], sampling, 0, continuations),
                                cfg.actor.max_sequences_per_request, ep.batch_window_ms / 1000,
                                lambda ids: core.tokenizer.decode(ids, skip_special_tokens=True),
                                core.endpoint_stats, core.sessions.pending)
    endpoint = Endpoint(core.sessions, batcher, core.tokenizer, token, "policy", ep.max_new_tokens)
    return HttpServer(endpoint.app(), ep.host, ep.port, tls, role="actor", name="openai-endpoint")

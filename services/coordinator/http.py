"""The coordinator's HTTP control plane (FastAPI, served by uvicorn in the coordinator's event loop
beside its gRPC control service): run status, step history, the role map with each role's health,
pause, resume and stop, reward replicas added and removed. OpenAPI schema at /openapi.json; every error is JSON `{"error": message}`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from rolefleet.common.errors import RoleFleetError
from rolefleet.coordinator.scaling import RewardScaling
from rolefleet.coordinator.state import ControlError, RunState, RunStatus
from rolefleet.rpc.auth import AUTH_REFUSED, HEADER, token_matches
from rolefleet.rpc.http_server import HttpServer as HttpControlPlane  # noqa: F401 - the coordinator's server
from rolefleet.rpc.roles import ChannelSource, check_health, fetch_status, open_channel

STATES = tuple(s.name for s in RunState)
ROLE_TIMEOUT_S = 2.0


class StatusView(BaseModel):
    run_name: str
    state: Literal[STATES]  # type: ignore[valid-type]
    step: int = Field(description="steps completed")
    total_steps: int
    policy_version: int
    last_reward_mean: float
    paused: bool
    error: str = Field(description="why the run failed (state FAILED)")

    @classmethod
    def of(cls, s: RunStatus) -> StatusView:
        return cls(run_name=s.run_name, state=s.state.name, step=s.step, total_steps=s.total_steps,
                   policy_version=s.policy_version, last_reward_mean=s.last_reward_mean, paused=s.paused,
                   error=s.error)


class RoleView(BaseModel):
    role: str
    address: str
    health: str = Field(description="the gRPC health service's answer (SERVING, NOT_SERVING) or UNREACHABLE")
    devices: str | None = Field(None, description="the role's CUDA_VISIBLE_DEVICES ('' for none)")
    workers: int | None = None
    model_version: int | None = None
    last_step: int | None = None
    broken: str | None = Field(None, description="why the role refuses updates, if it does")
    engine: str | None = Field(None, description="the actor's rollout engine as it generates now (vllm, hf, "
                               "hf (transformers generate)); '' for other roles")
    error: str | None = Field(None, description="why the role's status could not be read")


class StepsPage(BaseModel):
    steps: list[dict[str, Any]] = Field(description="step records, keys as in metrics.jsonl (docs/metrics.md)")
    next_since: int = Field(description="pass as `since` to get the steps after these")


class ReplicaRequest(BaseModel):
    address: str = Field(description="HOST:PORT of a running reward server", max_length=300)


class Replicas(BaseModel):
    replicas: list[str] = Field(description="addresses of the reward replicas that get new work")


class ErrorBody(BaseModel):
    error: str


# Declared on every route, so the schema says what the handlers below send (FastAPI would document
# its own 422 body otherwise).
INVALID = {422: {"model": ErrorBody, "description": "a parameter is invalid"}}
ERRORS = {**INVALID, 409: {"model": ErrorBody, "description": "the run's state does not allow it"}}
BODY_ERRORS = {**ERRORS, 400: {"model": ErrorBody, "description": "the body is not JSON"}}
UNAUTHENTICATED = {401: {"model": ErrorBody, "description": "the run's token is missing or wrong"}}
HTTP_ROLE = "coordinator-http"  # the role label of the control plane's refusals


def make_app(status: RunStatus, addresses: dict[str, str], scaling: RewardScaling | None = None,
             token: str | None = None, channels: ChannelSource = open_channel) -> FastAPI:
    """The control plane; with `token`, every route but /healthz needs `Authorization: Bearer <token>`;
    `channels`: where the role views' calls find their channels."""
    # Long by nature: one short handler per route, closed over the run's status, so the API reads as
    # the table it is (docs/http-api.md) and FastAPI builds its OpenAPI schema from these signatures.
    app = FastAPI(title="RoleFleet coordinator", version="1", responses=INVALID,
                  description="Control plane of one RoleFleet run (docs/http-api.md).")
    api = APIRouter(dependencies=[Depends(bearer_check(token))] if token else [],
                    responses=UNAUTHENTICATED if token else {})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": problems}, status_code=422)

    @app.exception_handler(ControlError)
    async def conflict(request: Request, exc: ControlError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=409)

    @app.get("/healthz", summary="liveness of the control plane")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/status", summary="the run's state and progress")
    async def get_status() -> StatusView:
        return StatusView.of(status)

    @api.get("/v1/steps", summary="step records after `since`, oldest first")
    async def get_steps(since: int = Query(-1, ge=-1, description="return records numbered above this (default: "
                                           "all, with step 0: an evaluation before training)"),
                        limit: int = Query(100, ge=1, le=1000, description="at most this many")) -> StepsPage:
        # Records are appended in step order, one per step (and one of step 0 with evaluation on).
        page = [r for r in status.history if r["step"] > since][:limit]
        return StepsPage(steps=page, next_since=page[-1]["step"] if page else since)

    @api.get("/v1/roles", summary="each role server: address, health, GPUs, workers, version")
    async def get_roles() -> list[RoleView]:
        return list(await asyncio.gather(*(role_view(label, address, channels) for label, address in addresses.items())))

    @api.get("/v1/reward/replicas", summary="the reward replicas in use")
    async def get_replicas() -> Replicas:
        return Replicas(replicas=scaling.replicas() if scaling else [])

    # One method per path (as the other routes): Starlette's 405 would list only the first route's.
    @api.post("/v1/reward/replicas/add", summary="give a running reward server a share of the work",
              responses=BODY_ERRORS)
    async def add_replica(body: ReplicaRequest) -> Replicas:
        try:
            return Replicas(replicas=await _scaling().add(body.address))
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)

    @api.post("/v1/reward/replicas/remove", summary="give a reward replica no new work (its calls in flight "
              "finish)", responses=BODY_ERRORS)
    async def remove_replica(body: ReplicaRequest) -> Replicas:
        return Replicas(replicas=_scaling().remove(body.address))

    def _scaling() -> RewardScaling:
        if scaling is None:
            raise ControlError("this control plane does not scale reward replicas")
        return scaling

    @api.post("/v1/pause", summary="start no new step until resumed (the step in flight finishes)",
              responses=ERRORS)
    async def pause() -> StatusView:
        status.pause()
        return StatusView.of(status)

    @api.post("/v1/resume", summary="let steps start again", responses=ERRORS)
    async def resume() -> StatusView:
        status.resume()
        return StatusView.of(status)

    @api.post("/v1/stop", summary="end the run after the step in flight", responses=ERRORS)
    async def stop() -> StatusView:
        if status.state in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED):
            raise ControlError(f"the run already ended ({status.state.name.lower()})")
        status.request_stop()
        return StatusView.of(status)

    app.include_router(api)
    return app


def bearer_check(token: str) -> Callable[..., Awaitable[None]]:
    """A dependency refusing requests without the run's token: 401, counted, the token never echoed."""
    scheme = HTTPBearer(auto_error=False, description="the run's token (security.token_file / ROLEFLEET_TOKEN)")

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:  # noqa: B008
        presented = None if credentials is None else [(HEADER, f"{credentials.scheme} {credentials.credentials}")]
        reason = token_matches(presented, token)
        if reason is not None:
            AUTH_REFUSED.labels(HTTP_ROLE, reason).inc()
            raise HTTPException(401, f"{reason} token: requests need `Authorization: Bearer <the run's token>`",
                                headers={"WWW-Authenticate": "Bearer"})

    return check


def role_of(label: str) -> str:
    """The role of a role-map label: `reward#2` (a further reward replica) -> reward."""
    return label.split("#", 1)[0]


async def role_view(label: str, address: str, channels: ChannelSource = open_channel) -> RoleView:
    role = role_of(label)
    health, view = await asyncio.gather(check_health(address, ROLE_TIMEOUT_S, channels),
                                        _status(role, address, channels))
    return RoleView(role=role, address=address, health=health, **view)


async def _status(role: str, address: str, channels: ChannelSource) -> dict[str, Any]:
    try:
        s = await fetch_status(role, address, ROLE_TIMEOUT_S, channels=channels)
    except RoleFleetError as exc:
        return {"error": str(exc)}
    return {"devices": s.devices, "workers": s.workers, "model_version": s.model_version,
            "last_step": s.last_step, "broken": s.broken, "engine": s.engine}

"""The coordinator process: the run loop plus its gRPC control service (status, stop)."""

from __future__ import annotations

import asyncio
from typing import Optional

import grpc

from rolefleet.actor.client import GrpcActorClient
from rolefleet.common.config import RoleFleetConfig, dial_host, dump_config
from rolefleet.common.errors import RoleFleetError, Unavailable
from rolefleet.common.pb import coordinator_pb2, coordinator_pb2_grpc
from rolefleet.coordinator.http import HttpControlPlane, make_app, role_of
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.scaling import RewardScaling
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.coordinator.trackers import open_trackers
from rolefleet.critic.client import GrpcCriticClient
from rolefleet.reward.client import GrpcRewardClient
from rolefleet.reward.replicas import ReplicatedRewardClient
from rolefleet.rpc.roles import ChannelSource, KeptChannels, fetch_status, open_channel, wait_healthy
from rolefleet.rpc.run_files import write_endpoints
from rolefleet.rpc.security import OPEN, Security
from rolefleet.rpc.server import (
    RoleServicer,
    StartupError,
    busy_port_error,
    rpc,
    serve_until_stopped,
    start_server,
    warn_if_exposed,
    write_ready_file,
)
from rolefleet.teacher.client import GrpcTeacherClient


class CoordinatorServicer(RoleServicer, coordinator_pb2_grpc.CoordinatorServiceServicer):
    role = "coordinator"

    def __init__(self, status: RunStatus, addresses: dict[str, str] | None = None,
                 channels: ChannelSource = open_channel):
        self.status = status
        self.addresses = addresses or {}
        self.channels = channels

    def _message(self) -> coordinator_pb2.RunStatus:
        s = self.status
        return coordinator_pb2.RunStatus(run_name=s.run_name, state=int(s.state), step=s.step,
                                         total_steps=s.total_steps, policy_version=s.policy_version,
                                         last_reward_mean=s.last_reward_mean, error=s.error)

    @rpc
    async def GetRunStatus(self, request, context):
        message = self._message()
        message.roles.extend(await asyncio.gather(*(role_view(role_of(label), address, channels=self.channels)
                                                    for label, address in self.addresses.items())))
        return message

    @rpc
    async def Stop(self, request, context):
        self.status.request_stop()
        return coordinator_pb2.StopResponse(state=int(self.status.state))


async def role_view(role: str, address: str, timeout_s: float = 2.0,
                    channels: ChannelSource = open_channel) -> coordinator_pb2.RoleView:
    """A role server's cheap status (its GPUs, workers, version), or why it did not answer."""
    try:
        status = await fetch_status(role, address, timeout_s, channels=channels)
    except RoleFleetError as exc:
        return coordinator_pb2.RoleView(address=address, error=f"{role}: {exc}")
    return coordinator_pb2.RoleView(address=address, status=status.to_proto())


def add_to_server(status: RunStatus, server: grpc.aio.Server, addresses: dict[str, str] | None = None,
                  channels: ChannelSource = open_channel) -> list[str]:
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(status, addresses, channels),
                                                                  server)
    return [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]


def role_addresses(cfg: RoleFleetConfig) -> dict[str, str]:
    """Where each role server this run needs is dialled (ConfigError when one cannot be known),
    by label: the role's name, and `reward#2`, `reward#3`, ... for further reward replicas."""
    addresses = {}
    for role in cfg.roles():
        if role == "reward" and cfg.reward.replicas:
            addresses.update({"reward" if i == 0 else f"reward#{i + 1}": a for i, a in enumerate(cfg.reward.replicas)})
        elif role != "coordinator":
            addresses[role] = getattr(cfg, role).dial_address(role)
    return addresses


async def connect_roles(cfg: RoleFleetConfig, addresses: dict[str, str], status: RunStatus,
                        channels: ChannelSource = open_channel) -> Roles:
    """gRPC clients for the configured roles, once each answers SERVING on its health service
    (a stop request ends the wait; `channels`: where the health checks' channels come from)."""
    timeout = cfg.train.rpc_timeout_s
    for role, address in addresses.items():
        await wait_healthy(role, address, cfg.train.connect_timeout_s, give_up=lambda: status.stop_requested,
                           channels=channels)
    rewards = [a for label, a in addresses.items() if role_of(label) == "reward"]
    return Roles(
        actor=GrpcActorClient(addresses["actor"], timeout),
        # Replicated even when one: replicas may be added while the run goes (coordinator/scaling.py).
        # It holds no training state: a call it loses to a restart is repeated (`calls.Retries`).
        reward=ReplicatedRewardClient([GrpcRewardClient(a, timeout) for a in rewards], labels=rewards),
        critic=GrpcCriticClient(addresses["critic"], timeout) if cfg.preset.uses_critic else None,
        # Frozen, as the reward role: a call it loses to a restart is repeated.
        teacher=GrpcTeacherClient(addresses["teacher"], timeout) if cfg.uses_teacher else None,
    )


def _failed(status: RunStatus, exc: Exception) -> RunStatus:
    status.state, status.error = RunState.FAILED, f"{type(exc).__name__}: {exc}"
    print(f"rolefleet: run failed at step {status.step + 1}: {status.error}", flush=True)
    return status


async def run_coordinator(cfg: RoleFleetConfig, ready_file: Optional[str] = None,
                          progress: bool = True, security: Security = OPEN) -> Optional[RunStatus]:
    """Serve the control service and run the loop; None when a signal cancelled it while starting."""
    addresses = role_addresses(cfg)  # before anything starts: a config without them is an error
    out = cfg.run.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    status = RunStatus(run_name=cfg.run.name, total_steps=cfg.train.total_steps)
    scaling = RewardScaling(cfg.train.rpc_timeout_s)
    # The status views' channels, opened by the start's health checks: a view then connects to nothing.
    channels = KeptChannels()
    http = start_http(cfg, status, addresses, scaling, security, channels)
    try:
        handle = await start_server("coordinator", cfg.coordinator,
                                    lambda server: add_to_server(status, server, addresses, channels), security)
    except BaseException:
        if http is not None:
            await http.stop()
        await channels.close()
        raise
    if ready_file:
        write_ready_file(ready_file, handle, **({"http_port": http.port} if http else {}))
    write_endpoints(out, f"{dial_host(cfg.coordinator.host)}:{handle.grpc_port}",
                    f"{http.scheme}://{dial_host(http.host)}:{http.port}" if http else None)

    async def work() -> RunStatus:
        # Printed once the signal handlers are in place, so a stop right after it is handled.
        print(f"rolefleet: run {cfg.run.name}: `rolefleet status --run {out}` (or `--address "
              f"{dial_host(cfg.coordinator.host)}:{handle.grpc_port}`) shows its progress"
              + (f"; HTTP control plane on {http.scheme}://{dial_host(http.host)}:{http.port}" if http else ""), flush=True)
        try:
            roles = await connect_roles(cfg, addresses, status, channels)
        except Unavailable as exc:
            if status.stop_requested:
                status.state = RunState.STOPPED
                return status
            return _failed(status, exc)
        scaling.client = roles.reward
        try:
            logger = run_logger(cfg, progress)
        except Exception as exc:  # noqa: BLE001 - a tracker that cannot start (W&B without a login, say)
            await close_clients(roles)
            return _failed(status, exc)
        try:
            return await train(cfg, roles, logger, status)
        except Exception as exc:  # noqa: BLE001 - the run reports any failure through its status
            return _failed(status, exc)
        finally:
            logger.close()
            print(f"rolefleet: {logger.summary()}", flush=True)
            scaling.client = None
            await close_clients(roles)

    try:
        return await serve_until_stopped(handle, work=work(), on_signal=status.request_stop)
    finally:
        if http is not None:
            await http.stop()
        await channels.close()


def run_logger(cfg: RoleFleetConfig, progress: bool) -> RunLogger:
    t, out = cfg.tracking, cfg.run.out
    trackers = open_trackers(t.backends, out, cfg.run.name, t.project, cfg.model_dump(mode="json"), t.wandb_mode,
                             t.mlflow_tracking_uri)
    return RunLogger(out, cfg.train.total_steps, progress=progress, trackers=trackers, resume=cfg.run.resume)


async def close_clients(roles: Roles) -> None:
    for client in (roles.actor, roles.reward, roles.critic):
        if client is not None:
            await client.close()


def start_http(cfg: RoleFleetConfig, status: RunStatus, addresses: dict[str, str],
               scaling: Optional[RewardScaling] = None, security: Security = OPEN,
               channels: ChannelSource = open_channel) -> Optional[HttpControlPlane]:
    """The HTTP control plane, bound (None when `coordinator.http_enabled` is false)."""
    c = cfg.coordinator
    if not c.http_enabled:
        return None
    try:
        http = HttpControlPlane(make_app(status, addresses, scaling, security.token, channels), c.http_host, c.http_port,
                                cfg.security.tls)
    except OSError as exc:
        raise StartupError(busy_port_error("coordinator", "http", c.http_host, c.http_port, exc)) from None
    warn_if_exposed("coordinator", "the HTTP control plane", c.http_host, security)
    return http

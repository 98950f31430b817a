"""`rolefleet serve ROLE`: run one role server until SIGTERM (what compose and Helm start)."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from typing import Optional

import grpc

from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.gpu_metrics import GpuSampler
from rolefleet.rpc.security import Security, refuse_if_open
from rolefleet.rpc.server import (
    StartupError,
    check_ports_free,
    serve_until_stopped,
    start_server,
    write_ready_file,
)
from rolefleet.trainer.threads import set_threads

log = logging.getLogger(__name__)

AddServicers = Callable[[grpc.aio.Server], list[str]]


def _actor(cfg: RoleFleetConfig, group=None):
    from rolefleet.actor import server
    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.placement import rollout_ranks

    core = ActorCore(cfg.actor, seed=cfg.run.seed, max_staleness=cfg.pipeline.staleness_bound,
                     rollout_ranks=rollout_ranks(cfg), group=group)
    core.checkpoint_root = cfg.checkpoint.root(cfg.run)
    return core, functools.partial(server.add_to_server, core)


def _reward(cfg: RoleFleetConfig, group=None):
    from rolefleet.reward import server
    from rolefleet.reward.core import RewardCore

    core = RewardCore(cfg.reward)
    return core, functools.partial(server.add_to_server, core)


def _critic(cfg: RoleFleetConfig, group=None):
    from rolefleet.critic import server
    from rolefleet.critic.core import CriticCore

    core = CriticCore(cfg.critic, seed=cfg.run.seed, max_staleness=cfg.pipeline.staleness_bound, group=group)
    core.checkpoint_root = cfg.checkpoint.root(cfg.run)
    return core, functools.partial(server.add_to_server, core)


# Model-serving roles: build the core (load models) first, then open the port, so that SERVING
# means ready. The coordinator is different (it runs the loop): see rolefleet.coordinator.server.
ROLE_BUILDERS = {"actor": _actor, "reward": _reward, "critic": _critic}
GROUP_ROLES = ("actor", "critic")  # roles that can run over several worker processes


def worker_factory(role: str):
    """What each other rank of `role`'s group builds: its worker (`trainer/workers.py`)."""
    if role == "actor":
        from rolefleet.actor.worker import ActorWorker

        return ActorWorker.from_config
    from rolefleet.critic.worker import CriticWorker

    return CriticWorker.from_config


def worker_count(role: str, cfg: RoleFleetConfig) -> int:
    """One worker per GPU of the role's device group, or `<role>.workers` (CPU groups)."""
    if role not in GROUP_ROLES:
        return 1
    return getattr(cfg, role).workers or max(1, len(getattr(cfg.devices, role)))


def bound_hosts(cfg: RoleFleetConfig, role: str) -> dict[str, str]:
    """The interfaces `role`'s servers bind, by config key (the coordinator's control plane too)."""
    hosts = {f"{role}.host": getattr(cfg, role).host}
    if role == "coordinator" and cfg.coordinator.http_enabled:
        hosts["coordinator.http_host"] = cfg.coordinator.http_host
    return hosts


def run_security(cfg: RoleFleetConfig, role: str) -> Security:
    """What `role`'s server demands and its calls present (`client`: a process that only calls);
    its own channels use it from now on."""
    from rolefleet.rpc.roles import use_security

    try:
        security = Security.of(cfg.security, role)
        if role != "client":
            refuse_if_open(role, bound_hosts(cfg, role), security, cfg.security)
    except ValueError as exc:  # TokenError, TlsError, Unauthenticated: they name the keys, never a secret
        raise StartupError(str(exc)) from None
    use_security(security)
    return security


async def serve_role(role: str, cfg: RoleFleetConfig, ready_file: Optional[str] = None) -> int:
    set_threads(getattr(cfg, role).num_threads)
    security = run_security(cfg, role)
    check_ports_free(role, getattr(cfg, role))
    if role == "coordinator":
        from rolefleet.coordinator.server import run_coordinator
        from rolefleet.coordinator.state import RunState

        status = await run_coordinator(cfg, ready_file, security=security)
        if status is not None:
            # The last line a supervisor (or a test) reads: how the run ended, and after which step.
            print(f"rolefleet: run {cfg.run.name} ended {status.state.name} after step {status.step}/"
                  f"{status.total_steps}", flush=True)
        return 0 if status is not None and status.state in (RunState.FINISHED, RunState.STOPPED) else 1
    if role not in ROLE_BUILDERS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join([*ROLE_BUILDERS, 'coordinator'])}")
    section = getattr(cfg, role)
    world = worker_count(role, cfg)
    group = None
    if world > 1:
        from rolefleet.trainer.workers import WorkerGroup

        group = WorkerGroup.start(role, world, cfg.model_dump(mode="json"), worker_factory(role))
    core, add_servicers = ROLE_BUILDERS[role](cfg, group)
    handle = await start_server(role, section, add_servicers, security)
    if ready_file:
        write_ready_file(ready_file, handle)
    gpu_sampler = GpuSampler.start_for(role, getattr(cfg.devices, role))  # None without NVIDIA GPUs
    watch = asyncio.ensure_future(handle.report_broken(lambda: core.status().broken))  # noqa: RUF006 - until exit

    def close() -> None:
        if gpu_sampler is not None:
            gpu_sampler.stop()
        core.close()
        if group is not None:
            group.stop()

    await serve_until_stopped(handle, close=close)
    watch.cancel()
    log.info("%s stopped", role)
    return 0


def run(role: str, cfg: RoleFleetConfig, ready_file: Optional[str] = None) -> int:
    try:
        return asyncio.run(serve_role(role, cfg, ready_file))
    except StartupError as exc:
        print(f"rolefleet: {exc}", file=sys.stderr, flush=True)
        return 1

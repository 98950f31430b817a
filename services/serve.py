"""`rolefleet serve ROLE`: run one role server until SIGTERM (what compose and Helm start)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Optional

import grpc
from prometheus_client import start_http_server

from rolefleet.actor.placement import rollout_ranks
from rolefleet.common import progress
from rolefleet.common.config import RoleFleetConfig, split_device
from rolefleet.common.gpu_metrics import GpuSampler
from rolefleet.coordinator.state import RunState
from rolefleet.launch import in_torchrun, launch_node, rank_main
from rolefleet.rpc.roles import use_security
from rolefleet.rpc.security import Security, refuse_if_open
from rolefleet.rpc.server import (
    StartupError,
    busy_port_error,
    check_ports_free,
    serve_until_stopped,
    start_server,
    write_ready_file,
)
from rolefleet.trainer.nodes import layout_for, node_problem
from rolefleet.trainer.threads import set_threads
from rolefleet.trainer.workers import WorkerGroup

log = logging.getLogger(__name__)

AddServicers = Callable[[grpc.aio.Server], list[str]]


def _actor(cfg: RoleFleetConfig, group=None):
    # A role's core loads the model libraries (its server imports it): not for the coordinator's process,
    # which imports this module (tests/coordinator/test_imports.py).
    from rolefleet.actor import server
    from rolefleet.actor.core import ActorCore  # as above

    core = ActorCore(cfg.actor, seed=cfg.run.seed, max_staleness=cfg.pipeline.staleness_bound,
                     rollout_ranks=rollout_ranks(cfg), group=group)
    core.checkpoint_root, core.snapshot_root = cfg.checkpoint.root(cfg.run), cfg.checkpoint.snapshot.root(cfg.run)
    return core, functools.partial(server.add_to_server, core)


def _reward(cfg: RoleFleetConfig, group=None):
    from rolefleet.reward import server  # role core: as in _actor
    from rolefleet.reward.core import RewardCore  # role core: as in _actor

    core = RewardCore(cfg.reward, cfg.security.tls)
    return core, functools.partial(server.add_to_server, core)


def _critic(cfg: RoleFleetConfig, group=None):
    from rolefleet.critic import server  # role core: as in _actor
    from rolefleet.critic.core import CriticCore  # role core: as in _actor

    core = CriticCore(cfg.critic, seed=cfg.run.seed, max_staleness=cfg.pipeline.staleness_bound, group=group)
    core.checkpoint_root, core.snapshot_root = cfg.checkpoint.root(cfg.run), cfg.checkpoint.snapshot.root(cfg.run)
    return core, functools.partial(server.add_to_server, core)


def _teacher(cfg: RoleFleetConfig, group=None):
    from rolefleet.teacher import server  # role core: as in _actor
    from rolefleet.teacher.core import TeacherCore  # role core: as in _actor

    core = TeacherCore.from_config(cfg)
    return core, functools.partial(server.add_to_server, core)


# Model-serving roles: build the core (load models) first, then open the port, so that SERVING
# means ready. The coordinator is different (it runs the loop): see rolefleet.coordinator.server.
ROLE_BUILDERS = {"actor": _actor, "reward": _reward, "critic": _critic, "teacher": _teacher}
NODE_RANK_ENV = "ROLEFLEET_NODE_RANK"  # `--node-rank` from the environment (a pod's index)
POD_NAME_ENV = "ROLEFLEET_POD_NAME"  # else the ordinal a StatefulSet's pod name ends with


def worker_factory(role: str):
    """What each other rank of `role`'s group builds: its worker (`trainer/workers.py`)."""
    if role == "actor":
        from rolefleet.actor.worker import ActorWorker  # loads the model libraries: as in _actor

        return ActorWorker.from_config
    from rolefleet.critic.worker import CriticWorker  # loads the model libraries: as in _actor

    return CriticWorker.from_config


def node_rank_of(flag: Optional[int], env: dict[str, str]) -> int:
    """This process's node in its role's group: `--node-rank`, else ROLEFLEET_NODE_RANK, else the
    ordinal ending ROLEFLEET_POD_NAME (`actor-nodes-2`: 2), else 0 (the server process). Raises
    StartupError naming the source of a value that is not a node rank."""
    if flag is not None:
        source, text = "--node-rank", str(flag)
    elif env.get(NODE_RANK_ENV, "").strip():
        source, text = NODE_RANK_ENV, env[NODE_RANK_ENV].strip()
    elif env.get(POD_NAME_ENV, "").strip():
        source, text = POD_NAME_ENV, env[POD_NAME_ENV].strip().rpartition("-")[2]
    else:
        return 0
    if not text.isdigit():
        raise StartupError(f"{source}={text!r} is not a node rank: a whole number from 0 (the role's server "
                           "process) to the role's nodes - 1")
    return int(text)


def node_devices(cfg: RoleFleetConfig, role: str, node: int) -> list:
    """The entries of devices.<role> on the role's `node`-th node (all of them on one node)."""
    by_node = cfg.devices.by_node(role)
    if len(by_node) <= 1:
        return list(getattr(cfg.devices, role))
    name = by_node[node][0]
    return [d for d in getattr(cfg.devices, role) if split_device(d)[0] == name]


def serve_node(role: str, cfg: RoleFleetConfig, node: int, ready_file: Optional[str]) -> int:
    """One node of a role whose worker group spans nodes: this node's agent (`launch.py`),
    whose rank 0 on node 0 serves the role. Another node's metrics port serves its node's GPUs
    (no gRPC: rank 0 serves that)."""
    layout = layout_for(role, cfg)
    if (problem := node_problem(node, layout, role)) is not None:
        raise StartupError(problem)
    sampler = None
    if node:
        section = getattr(cfg, role)
        try:
            start_http_server(section.metrics_port, addr=section.host)
        except OSError as exc:
            raise StartupError(busy_port_error(role, "metrics", section.host, section.metrics_port, exc)) from None
        sampler = GpuSampler.start_for(role, node_devices(cfg, role, node))
    try:
        return launch_node(role, cfg, node, ready_file)
    finally:
        if sampler is not None:
            sampler.stop()


def bound_hosts(cfg: RoleFleetConfig, role: str) -> dict[str, str]:
    """The interfaces `role`'s servers bind, by config key (the coordinator's control plane too)."""
    hosts = {f"{role}.host": getattr(cfg, role).host}
    if role == "coordinator" and cfg.coordinator.http_enabled:
        hosts["coordinator.http_host"] = cfg.coordinator.http_host
    return hosts


def run_security(cfg: RoleFleetConfig, role: str) -> Security:
    """What `role`'s server demands and its calls present (`client`: a process that only calls);
    its own channels use it from now on."""
    try:
        security = Security.of(cfg.security, role)
        if role != "client":
            refuse_if_open(role, bound_hosts(cfg, role), security, cfg.security)
    except ValueError as exc:  # TokenError, TlsError, Unauthenticated: they name the keys, never a secret
        raise StartupError(str(exc)) from None
    use_security(security)
    return security


async def serve_role(role: str, cfg: RoleFleetConfig, ready_file: Optional[str] = None, group=None) -> int:
    """Serve `role` until SIGTERM; `group`: its worker group when the launcher formed it (over nodes),
    else this process starts one on this node where the role has several workers."""
    set_threads(getattr(cfg, role).num_threads)
    security = run_security(cfg, role)
    check_ports_free(role, getattr(cfg, role))
    if role == "coordinator":
        # The coordinator's server (its loop, HTTP control plane, trackers) only in its own process.
        from rolefleet.coordinator.server import run_coordinator

        status = await run_coordinator(cfg, ready_file, security=security)
        if status is not None:
            # The last line a supervisor (or a test) reads: how the run ended, and after which step.
            print(f"rolefleet: run {cfg.run.name} ended {status.state.name} after step {status.step}/"
                  f"{status.total_steps}", flush=True)
        return 0 if status is not None and status.state in (RunState.FINISHED, RunState.STOPPED) else 1
    if role not in ROLE_BUILDERS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join([*ROLE_BUILDERS, 'coordinator'])}")
    section = getattr(cfg, role)
    layout = layout_for(role, cfg)
    if group is None and layout.world > 1:
        progress.report(f"starting {layout.world} worker processes")
        group = WorkerGroup.start(role, layout.world, cfg.model_dump(mode="json"), worker_factory(role))
    models = role != "reward" or any(s.kind == "model" for s in cfg.reward.scoring_sources())
    progress.report("loading models" if models else "loading reward functions")
    core, add_servicers = ROLE_BUILDERS[role](cfg, group)
    progress.report("opening its ports")
    handle = await start_server(role, section, add_servicers, security)
    front = await front_door(role, cfg, core, security)
    if ready_file:
        write_ready_file(ready_file, handle, **({"endpoint_port": front.port} if front else {}))
    progress.report("serving")
    gpu_sampler = GpuSampler.start_for(role, node_devices(cfg, role, 0))  # None without NVIDIA GPUs
    watch = asyncio.ensure_future(handle.report_broken(lambda: core.status().broken))  # noqa: RUF006 - until exit

    def close() -> None:
        if gpu_sampler is not None:
            gpu_sampler.stop()
        core.close()
        if group is not None:
            group.stop()

    await serve_until_stopped(handle, close=close)
    watch.cancel()
    if front is not None:
        await front.stop()
    log.info("%s stopped", role)
    return 0


async def front_door(role: str, cfg: RoleFleetConfig, core, security: Security):
    """The actor's OpenAI-compatible endpoint where agents drive episodes (actor.endpoint), else None."""
    if role != "actor" or not cfg.actor.endpoint.enabled:
        return None
    from rolefleet.actor.openai_api import start_endpoint  # the actor's process alone: as in _actor

    ep = cfg.actor.endpoint
    try:
        server = await start_endpoint(core, cfg, cfg.security.tls, security.token)
    except OSError as exc:
        raise StartupError(busy_port_error(role, "endpoint", ep.host, ep.port, exc)) from None
    progress.report(f"OpenAI-compatible endpoint on {server.scheme}://{server.host}:{server.port}")
    return server


def run(role: str, cfg: RoleFleetConfig, ready_file: Optional[str] = None, node_rank: int = 0) -> int:
    """Serve `role`; over several nodes, be node `node_rank`'s agent of its worker group (node 0's
    rank 0 serves); started by torchrun, be one rank of the group."""
    progress.report("config loaded")
    try:
        if in_torchrun():  # a launcher of the user's (PyTorchJob, srun torchrun) started this rank
            rank_main(role, cfg.model_dump(mode="json"), node_rank or int(os.environ.get("GROUP_RANK", "0")),
                      ready_file or "")
            return 0
        if layout_for(role, cfg).spans:
            return serve_node(role, cfg, node_rank, ready_file)
        if (problem := node_problem(node_rank, layout_for(role, cfg), role)) is not None:
            raise StartupError(problem)
        return asyncio.run(serve_role(role, cfg, ready_file))
    except StartupError as exc:
        print(f"rolefleet: {exc}", file=sys.stderr, flush=True)
        return 1

"""A role's worker group over several nodes, launched the way torchrun launches one.

On every node, `rolefleet serve ROLE --node-rank K` is torch.distributed.elastic's agent: it meets
the other nodes' agents in the c10d rendezvous at the role's first node (`<role>.rendezvous`),
starts this node's ranks and supervises them. A rank that fails takes the agent's own failure path
with no restart of its own (`max_restarts=0`): the agent ends its other ranks and exits 1, the other
nodes' ranks lose their peer and end theirs, and the supervisor (`rolefleet up`, Kubernetes, a
compose restart policy) starts every process of the role again; the run recovers from its checkpoint.

Ranks are numbered by the layout (`trainer/nodes.py`: node by node), not in the rendezvous's order:
rank 0, on node 0, is the role's server (gRPC, the controller) and drives the others over the
group's own collectives (`trainer/workers.py`: `GroupChannel`). No socket of the project's own
carries commands, and the run's token keys nothing here: the group's ports (the rendezvous store,
gloo's) trust whoever reaches them, which is why a deployment keeps them to the role's own nodes
(the Helm chart's NetworkPolicy, docs/security.md).

torchrun itself (a PyTorchJob, `srun torchrun -m rolefleet.cli serve ROLE ...`) may start the ranks
instead: `rolefleet serve` started by it is one rank (`rank_main`), its node from `--node-rank` or
the launcher's GROUP_RANK.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import multiprocessing
import os
import signal
import socket
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from rolefleet.common.config import RoleFleetConfig, parse_config
from rolefleet.common.orphans import exit_with_parent
from rolefleet.rpc.server import StartupError
from rolefleet.trainer.nodes import NodeLayout, layout_for
from rolefleet.trainer.threads import set_threads
from rolefleet.trainer.workers import WorkerGroup, join_group, worker_loop

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


def in_torchrun() -> bool:
    """Whether this process is a rank that torch's elastic agent (torchrun, ours) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def own_address(host: str, port: int) -> str:
    """This node's address as the others reach it: the interface that routes to the first node (no
    packet is sent; a UDP socket's connect only picks the route), loopback for a group on loopback."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return LOOPBACK
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def launch_node(role: str, cfg: RoleFleetConfig, node: int, ready_file: str | None) -> int:
    """Be node `node`'s agent of `role`'s group until its ranks end; the node's exit code. Raises
    StartupError when the group cannot form (the rendezvous timed out, the first node never answered)."""
    layout = layout_for(role, cfg)
    r = getattr(cfg, role).rendezvous
    where, who = f"{r.host}:{r.port}", f"{role}: {layout.describe(node)}"
    config = LaunchConfig(
        min_nodes=layout.nodes, max_nodes=layout.nodes, nproc_per_node=layout.counts[node],
        run_id=f"{cfg.run.name}-{role}", role=role, rdzv_backend="c10d", rdzv_endpoint=where,
        # Every node is needed (min = max), so the last call need not wait for latecomers; node 0 hosts.
        rdzv_configs={"join_timeout": int(r.timeout_s), "last_call_timeout": 1, "is_host": node == 0,
                      "read_timeout": int(r.timeout_s)},
        max_restarts=0, monitor_interval=0.5, start_method="spawn", local_addr=own_address(r.host, r.port),
        # SIGTERM is ours (below), not the agent's: the agent would end its ranks itself and leave
        # the other nodes' agents waiting at their exit barrier for one that is gone.
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT")
    raw = cfg.model_dump(mode="json")  # before the handler: a SIGTERM must not land inside the serializer
    signal.signal(signal.SIGTERM, _stop_in_order)
    log.info("%s joining the rendezvous at %s", who, where)
    try:
        elastic_launch(config, rank_main)(role, raw, node, ready_file or "")
    except ChildFailedError as exc:
        for failure in exc.failures.values():
            log.error("%s: rank %d exited with code %s; ending this node", who,
                      layout.first_rank(node) + failure.local_rank, failure.exitcode)
        return 1
    except RendezvousError as exc:
        raise StartupError(_rendezvous_problem(role, layout, node, where, r.timeout_s, exc)) from None
    log.info("%s: its ranks stopped", who)
    return 0


def _stop_in_order(*_) -> None:
    """SIGTERM to an agent: passed on to its ranks. Rank 0 stops the role as a server does (the step's
    calls finish, then STOP to every rank); the other ranks ignore it and end on that STOP, so every
    node's ranks end 0 and every agent leaves through its exit barrier. Before there are ranks (still
    meeting the other nodes) there is nothing to stop in order: the agent ends at once."""
    children = multiprocessing.active_children()
    if not children:
        raise SystemExit(0)
    for child in children:
        os.kill(child.pid, signal.SIGTERM)


def _rendezvous_problem(role: str, layout: NodeLayout, node: int, where: str, timeout_s: float,
                        exc: Exception) -> str:
    key = f"{role}.rendezvous"
    if node == 0:
        return (f"{role}: rendezvous timed out after {timeout_s:.0f} s ({key}.timeout_s) waiting at {where} for "
                f"the role's other {layout.nodes - 1} node(s): start `rolefleet serve {role} --node-rank K` on each "
                f"({type(exc).__name__}: {exc})")
    return (f"{role}: {layout.describe(node)}: the {role}'s first node did not answer at {where} ({key}.host, .port) "
            f"within {timeout_s:.0f} s ({key}.timeout_s): is `rolefleet serve {role}` (node 0) running there? "
            f"({type(exc).__name__}: {exc})")


def rank_main(role: str, raw_config: dict, node: int, ready_file: str) -> None:
    """A rank of `role`'s group, started by the agent of its node: join the group, then serve the
    role (rank 0) or run rank 0's commands until told to stop."""
    from rolefleet.serve import serve_role, worker_factory  # import cycle: rolefleet.serve imports this module

    cfg = parse_config(raw_config, [])
    layout = layout_for(role, cfg)
    local = int(os.environ["LOCAL_RANK"])
    rank = layout.first_rank(node) + local
    # The agent killed (SIGKILL, the OOM killer): a rank inside a collective with it would otherwise
    # wait for the collectives' timeout, holding its GPU.
    exit_with_parent(1, f"{role} rank {rank}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(message)s")
    world = int(os.environ["WORLD_SIZE"])
    if world != layout.world or int(os.environ["LOCAL_WORLD_SIZE"]) != layout.counts[node]:
        print(f"rolefleet: {role}: the launcher started {world} ranks ({os.environ['LOCAL_WORLD_SIZE']} on this "
              f"node) but the config lays out {layout.world} over {layout.nodes} node(s) ({layout.describe(node)})",
              file=sys.stderr, flush=True)
        sys.exit(1)
    set_threads(getattr(cfg, role).num_threads)
    r = getattr(cfg, role).rendezvous
    join_group(role, rank, layout, raw_config, own_address(r.host, r.port))
    if rank == 0:
        try:
            code = asyncio.run(serve_role(role, cfg, ready_file or None, group=WorkerGroup.formed(role, layout)))
        except StartupError as exc:
            print(f"rolefleet: {exc}", file=sys.stderr, flush=True)
            code = 1
        if code:
            sys.exit(code)
        return
    # Rank 0 ends the group in order (STOP); a SIGTERM from the agent must not end this rank first,
    # or rank 0 would read a lost rank as a failure while it stops.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker_loop(role, rank, worker_factory(role)(cfg))

"""The node process of a role whose worker group spans nodes: `rolefleet serve ROLE --node-rank K`
(K >= 1; node 0's process is the role's server, rank 0).

It joins the rendezvous at the role's first node, starts this node's ranks (each joins the
process group and takes its commands from rank 0, `workers.worker_main`), then supervises them as
torchrun's agent does: a heartbeat into rank 0's store every second, and the one failure path.
A rank that fails is reported in the store, naming this node, before the node's other ranks are
ended and the process exits 1: rank 0 reads it and ends the role. Rank 0 gone (its store no longer
answers, or a new formation's nonce is there) ends this node the same way, so the supervisor (or
Kubernetes) starts every process of the role again and the group forms anew.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta

from rolefleet.common.metrics import NODE_RANKS
from rolefleet.trainer.nodes import NodeLayout
from rolefleet.trainer.rendezvous import Keys, Rendezvous, RendezvousError, join_store, own_address

log = logging.getLogger(__name__)
BEAT_S = 1.0
STORE_TIMEOUT_S = 30.0  # a store call that waits longer: the first node's machine is gone


def run_node(role: str, node: int, layout: NodeLayout, rdzv: Rendezvous, raw_config: dict, factory: Callable) -> int:
    """Start node `node`'s ranks of `role`'s group and supervise them; the exit code of the node."""
    from rolefleet.trainer.workers import worker_main

    who = f"{role}: {layout.describe(node)}"
    store = join_store(rdzv, who)
    nonce = store.get(Keys.NONCE).decode()  # rank 0 writes it last: its listener is up
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    address = own_address(rdzv)
    store.set(Keys.node(node, "address"), address)
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    processes = [ctx.Process(target=worker_main, args=(role, factory, raw_config, rank, layout, rdzv, None, address),
                             name=f"{role}-rank{rank}", daemon=False) for rank in layout.ranks_of(node)]
    for p in processes:
        p.start()
    store.set(Keys.node(node, "joined"), f"{socket.gethostname()} pid {os.getpid()}")
    log.info("%s joined the rendezvous at %s; ranks %s started", who, rdzv.address, layout.ranks_of(node))
    return _supervise(who, node, processes, store, nonce, NODE_RANKS.labels(role, str(node)))


def _supervise(who: str, node: int, processes: list, store, nonce: str, alive) -> int:
    stopping = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping:
            codes = [p.exitcode for p in processes]
            alive.set(sum(code is None for code in codes))
            failed = [(p.name, code) for p, code in zip(processes, codes) if code not in (None, 0)]
            if failed:
                why = "; ".join(f"worker {name} exited with code {code}" for name, code in failed)
                _report(store, nonce, node, why)
                return _end(processes, f"{who}: {why}; ending this node")
            if all(code == 0 for code in codes):
                log.info("%s: its ranks stopped", who)
                return 0
            if (gone := _first_node_gone(store, nonce, node)) is not None:
                if _stopped_by_themselves(processes):  # the server stopped the group, then exited
                    log.info("%s: its ranks stopped", who)
                    return 0
                return _end(processes, f"{who}: {gone}; ending this node so the group forms anew")
            time.sleep(BEAT_S)
        _end(processes, f"{who}: stopped (SIGTERM)", level=logging.INFO)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped_by_themselves(processes: list, grace_s: float = 5.0) -> bool:
    """Whether every rank exits 0 within `grace_s` (they were told to stop just before)."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    return all(p.exitcode == 0 for p in processes)


def _first_node_gone(store, nonce: str, node: int) -> str | None:
    """Beat; or why this node's formation is over (None while it lives)."""
    try:
        if store.get(Keys.NONCE).decode() != nonce:
            return "the role's first node formed a new group (it was restarted)"
        store.add(Keys.node(node, "beat"), 1)
    except Exception as exc:  # noqa: BLE001 - DistStoreError, a reset connection: rank 0 is gone
        return f"the role's first node (rank 0, its rendezvous store) is gone ({type(exc).__name__})"
    return None


def _report(store, nonce: str, node: int, why: str) -> None:
    """Tell rank 0 why, in this formation's store only (a new one must not read an old failure)."""
    try:
        if store.get(Keys.NONCE).decode() == nonce:
            store.set(Keys.node(node, "failed"), why)
    except Exception:  # noqa: BLE001 - rank 0 gone already: nothing to tell
        pass


def _end(processes: list, message: str, level: int = logging.ERROR) -> int:
    log.log(level, "%s", message)
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(5)
    return 1


def node_problem(node: int, layout: NodeLayout, role: str) -> str | None:
    """Why `--node-rank node` cannot run `role`, or None (0, the server process, always can)."""
    if node == 0:
        return None
    if layout.nodes == 1:
        return (f"--node-rank {node}: {role}'s worker group is on one node ({role}.nodes, or devices.{role}'s "
                "\"node:i\" entries, name no other); leave --node-rank out (or ROLEFLEET_NODE_RANK unset)")
    if not 0 <= node < layout.nodes:
        return (f"--node-rank {node}: {role}'s worker group spans {layout.nodes} nodes, so the node rank is 0 (the "
                f"server process) to {layout.nodes - 1}")
    return None


__all__ = ["RendezvousError", "node_problem", "run_node"]

"""Where the processes of a role's worker group meet: torch.distributed's TCPStore (what torchrun's
static rendezvous uses), hosted by rank 0, the role's server process, on the role's first node.

Every rank joins the process group through it. For a group over several nodes it also carries the
few facts the node processes and rank 0 exchange (`Keys`): the formation's nonce, the port of rank
0's command listener, each node's arrival, address, heartbeat and, when one of its ranks fails,
why. Commands to another node's ranks travel over `multiprocessing.connection` (the pipes' own
send/recv, over TCP), authenticated with a key made from the run's token and the formation's nonce:
the store is open to anyone who reaches its port, the command channel is not.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import pickle
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

import torch.distributed as dist

from rolefleet.trainer.nodes import NodeLayout

log = logging.getLogger(__name__)
POLL_S = 0.2
LOOPBACK = "127.0.0.1"


class RendezvousError(RuntimeError):
    """The group could not form: a node that never arrived, a first node that never answered."""


class Keys:
    NONCE = "rolefleet/nonce"
    COMMANDS = "rolefleet/commands"

    @staticmethod
    def node(node: int, what: str) -> str:
        """`joined`, `address`, `beat` (a counter), `failed` (why) of node `node`."""
        return f"rolefleet/node/{node}/{what}"


@dataclass(frozen=True)
class Rendezvous:
    role: str
    host: str  # the first node, as the others dial it
    port: int  # 0 (a group on one node): rank 0's store picks a free port
    timeout_s: float
    secret: bytes = b""  # the run's token, when it has one

    @property
    def key(self) -> str:
        return f"{self.role}.rendezvous"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(socket.gethostbyname(self.host)).is_loopback
        except (OSError, ValueError):
            return False

    def at_port(self, port: int) -> Rendezvous:
        return Rendezvous(self.role, self.host, port, self.timeout_s, self.secret)

    def authkey(self, nonce: str) -> bytes:
        return hashlib.sha256(self.secret + b"\0" + nonce.encode()).digest()


def host_store(rdzv: Rendezvous) -> dist.TCPStore:
    """Rank 0's store. It listens on every interface (on `rdzv.port`); this process's own client dials
    it on loopback, where it is whatever name the other nodes know this one by."""
    try:
        return dist.TCPStore(LOOPBACK, rdzv.port, is_master=True,
                             wait_for_workers=False, timeout=timedelta(seconds=rdzv.timeout_s))
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(f"{rdzv.role}: cannot host the rendezvous on port {rdzv.port} ({rdzv.key}.port): "
                              f"{exc}") from None


def join_store(rdzv: Rendezvous, who: str, timeout_s: float | None = None) -> dist.TCPStore:
    """A client of rank 0's store; its constructor retries until the timeout."""
    timeout = timedelta(seconds=timeout_s or rdzv.timeout_s)
    try:
        return dist.TCPStore(rdzv.host, rdzv.port, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as exc:  # DistStoreError, a name that does not resolve
        raise RendezvousError(
            f"{who}: the {rdzv.role}'s first node did not answer at {rdzv.address} ({rdzv.key}.host, .port) within "
            f"{timeout.total_seconds():.0f} s ({rdzv.key}.timeout_s): is `rolefleet serve {rdzv.role}` (node 0) "
            f"running there? ({exc})") from None


def own_address(rdzv: Rendezvous) -> str:
    """This node's address as the others reach it: the interface that routes to the first node (no
    packet is sent; a UDP socket's connect only picks the route), loopback for a group on loopback."""
    if rdzv.loopback:
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((rdzv.host, rdzv.port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class FirstNode:
    """Rank 0's side of a group over several nodes: the store, the formation's nonce, the command
    listener; waits for every node, then for each of their ranks' command connections."""

    def __init__(self, rdzv: Rendezvous, layout: NodeLayout, store: dist.TCPStore):
        self.rdzv, self.layout, self.store = rdzv, layout, store
        self.nonce = secrets.token_hex(16)
        bind = LOOPBACK if rdzv.loopback else "0.0.0.0"
        # Every other node's ranks connect at once: a backlog for all of them.
        self.listener = Listener((bind, 0), backlog=max(16, layout.world), authkey=rdzv.authkey(self.nonce))
        store.set(Keys.COMMANDS, str(self.listener.address[1]))
        store.set(Keys.NONCE, self.nonce)  # last: a node that reads it finds the rest

    def wait_for_nodes(self) -> None:
        """Every other node's process arrived, within the timeout; otherwise name the missing ones."""
        deadline = time.monotonic() + self.rdzv.timeout_s
        waiting = list(range(1, self.layout.nodes))
        while waiting and time.monotonic() < deadline:
            waiting = [k for k in waiting if not self.store.check([Keys.node(k, "joined")])]
            if waiting:
                time.sleep(POLL_S)
        if waiting:
            missing = "; ".join(self.layout.describe(k) for k in waiting)
            raise RendezvousError(
                f"{self.rdzv.role}: rendezvous timed out after {self.rdzv.timeout_s:.0f} s ({self.rdzv.key}.timeout_s) "
                f"waiting at {self.rdzv.address} for {missing}: start `rolefleet serve {self.rdzv.role} --node-rank K` "
                "on each (Helm: its pod), or check that it reaches this address")
        log.info("%s: all %d nodes arrived at %s", self.rdzv.role, self.layout.nodes, self.rdzv.address)

    def accept_ranks(self) -> dict[int, Remote]:
        """The command connection of every rank on another node, each announcing its rank first."""
        remote = [r for k in range(1, self.layout.nodes) for r in self.layout.ranks_of(k)]
        conns: dict[int, Remote] = {}

        def accept() -> None:
            while len(conns) < len(remote):
                try:
                    channel = Remote(self.listener.accept())
                    conns[channel.recv()] = channel
                except (OSError, EOFError, AuthenticationError) as exc:  # a stranger, or a stale node
                    log.warning("%s: refused a command connection (%s)", self.rdzv.role, exc)

        thread = threading.Thread(target=accept, name=f"{self.rdzv.role}-accept", daemon=True)
        thread.start()
        thread.join(self.rdzv.timeout_s)
        missing = [r for r in remote if r not in conns]
        if missing:
            nodes = sorted({self.layout.node_of(r) for r in missing})
            raise RendezvousError(f"{self.rdzv.role}: ranks {missing} of {', '.join(map(self.layout.describe, nodes))} "
                                  f"did not connect within {self.rdzv.timeout_s:.0f} s ({self.rdzv.key}.timeout_s)")
        self.listener.close()
        return conns


class Remote:
    """A command channel to another node, with a pipe's send and recv. Plain pickle: a Connection's
    own pickler (torch's reductions) would pass tensors as shared-memory handles, which mean nothing
    on another machine."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def send(self, obj) -> None:
        self._conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self._conn.recv_bytes())

    def readable(self) -> bool:
        """Data or the end of the connection waiting (never blocks)."""
        return self._conn.poll(0)

    def wait_closed(self, timeout_s: float) -> bool:
        """Whether the other end closed within `timeout_s` (a stopped rank exits after STOP)."""
        deadline = time.monotonic() + timeout_s
        try:
            while self._conn.poll(max(0.0, deadline - time.monotonic())):
                self._conn.recv_bytes()  # nothing is expected after STOP: only the end
        except (EOFError, OSError):
            return True
        return False

    def close(self) -> None:
        self._conn.close()


def connect_commands(rdzv: Rendezvous, store: dist.TCPStore, rank: int) -> Remote:
    """A rank on another node: its command channel to rank 0."""
    nonce = store.get(Keys.NONCE).decode()
    port = int(store.get(Keys.COMMANDS))
    channel = Remote(Client((rdzv.host, port), authkey=rdzv.authkey(nonce)))
    channel.send(rank)
    return channel


class NodeWatch:
    """Rank 0's view of the other nodes while the group lives: a node whose process reported a failed
    rank, or whose heartbeat stopped (its process or machine gone), ends the role."""

    def __init__(self, rdzv: Rendezvous, layout: NodeLayout, stale_after_s: float):
        self.rdzv, self.layout, self.stale_after_s = rdzv, layout, stale_after_s
        self._store: dist.TCPStore | None = None  # its own client: the watch runs on a thread of its own
        self._beats: dict[int, tuple[int, float]] = {}

    def problem(self) -> str | None:
        """Why a node is lost, or None."""
        if self._store is None:
            here = Rendezvous(self.rdzv.role, LOOPBACK, self.rdzv.port, self.rdzv.timeout_s)
            self._store = join_store(here, f"{self.rdzv.role} node watch")
        for k in range(1, self.layout.nodes):
            failed = Keys.node(k, "failed")
            if self._store.check([failed]):
                return f"{self.layout.describe(k)}: {self._store.get(failed).decode()}"
            if not self._store.check([Keys.node(k, "joined")]):
                continue  # not arrived yet: the rendezvous' own timeout covers it
            beat, now = self._store.add(Keys.node(k, "beat"), 0), time.monotonic()
            last, since = self._beats.get(k, (-1, now))
            if beat != last:
                self._beats[k] = (beat, now)
            elif now - since > self.stale_after_s:
                return (f"{self.layout.describe(k)}: its node process stopped answering (no heartbeat for "
                        f"{now - since:.0f} s)")
        return None

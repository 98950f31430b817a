"""How a role's worker ranks lie on its nodes (DESIGN "Process model": a group may span nodes).

Ranks are numbered node by node: node 0 (the role's first node, whose first rank is the server
process) holds ranks 0..n0-1, node 1 the next n1, and so on. On GPUs each node's ranks drive that
node's GPUs of the devices map in order (its local index: `CUDA_VISIBLE_DEVICES` entry); on the
CPU `<role>.workers` are split evenly over `<role>.nodes`. Pure data: every process of the group
(rank 0, the node processes, each rank) computes the same layout from the same config.
"""

from __future__ import annotations

from dataclasses import dataclass

from rolefleet.common.config import RoleFleetConfig

GROUP_ROLES = ("actor", "critic")  # roles that can run over several worker processes


@dataclass(frozen=True)
class NodeLayout:
    counts: tuple[int, ...] = (1,)  # ranks of each node
    names: tuple[str, ...] = ()  # each node's name (the devices map's); unnamed: nodeK

    def name(self, node: int) -> str:
        return self.names[node] if node < len(self.names) else f"node{node}"

    @property
    def world(self) -> int:
        return sum(self.counts)

    @property
    def nodes(self) -> int:
        return len(self.counts)

    @property
    def spans(self) -> bool:
        """Whether the group needs processes on several nodes."""
        return self.nodes > 1

    def first_rank(self, node: int) -> int:
        return sum(self.counts[:node])

    def ranks_of(self, node: int) -> list[int]:
        start = self.first_rank(node)
        return list(range(start, start + self.counts[node]))

    def node_of(self, rank: int) -> int:
        for node in range(self.nodes):
            if rank < self.first_rank(node) + self.counts[node]:
                return node
        raise ValueError(f"rank {rank} is outside the group of {self.world}")

    def local_index(self, rank: int) -> int:
        """The rank's place on its node: the node's GPU (visible-device index) it drives."""
        return rank - self.first_rank(self.node_of(rank))

    def same_node(self, ranks: list[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) <= 1

    def describe(self, node: int) -> str:
        """`node 1 (gpu-b, ranks 4-7)`: how logs and errors name a node."""
        ranks = self.ranks_of(node)
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {node} ({self.name(node)}, {span})"


def layout_for(role: str, cfg: RoleFleetConfig) -> NodeLayout:
    """`role`'s layout: one worker per GPU of its device group, node by node as the map names them,
    or `<role>.workers` over `<role>.nodes` on the CPU (the config refuses what cannot be)."""
    if role not in GROUP_ROLES:
        return NodeLayout()
    section = getattr(cfg, role)
    gpus = cfg.devices.by_node(role)
    if gpus:
        return NodeLayout(tuple(len(indices) for _, indices in gpus),
                          tuple(node or "node0" for node, _ in gpus))
    workers, nodes = section.workers or 1, section.nodes or 1
    if workers % nodes:  # refused by the config's own check (root.py: _nodes_fit)
        raise ValueError(f"{role}.workers={workers} do not split evenly over {role}.nodes={nodes}")
    return NodeLayout((workers // nodes,) * nodes)


def worker_count(role: str, cfg: RoleFleetConfig) -> int:
    """One worker per GPU of the role's device group, or `<role>.workers` (CPU groups), over all its nodes."""
    if role not in GROUP_ROLES:
        return 1
    return getattr(cfg, role).workers or max(1, len(getattr(cfg.devices, role)))


def node_problem(node: int, layout: NodeLayout, role: str) -> str | None:
    """Why `--node-rank node` cannot run `role`, or None (0, the server's node, always can)."""
    if node == 0:
        return None
    if layout.nodes == 1:
        return (f"--node-rank {node}: {role}'s worker group is on one node ({role}.nodes, or devices.{role}'s "
                "\"node:i\" entries, name no other); leave --node-rank out (or ROLEFLEET_NODE_RANK unset)")
    if not 0 <= node < layout.nodes:
        return (f"--node-rank {node}: {role}'s worker group spans {layout.nodes} nodes, so the node rank is 0 (the "
                f"server process) to {layout.nodes - 1}")
    return None

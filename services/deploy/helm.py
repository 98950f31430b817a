"""Chart values (deploy/helm/rolefleet) from a run config's devices map.

`values_for(cfg)` gives each role of the run its pod's GPU count (the number of entries in
`devices.<role>`, as `rolefleet serve` checks it) and, for `"node:i"` entries, a nodeSelector on
`kubernetes.io/hostname`. A trainer (actor, critic) whose entries name several nodes spans them:
one pod per node (`nodes`, the chart's StatefulSet), each with that node's GPU count, on the nodes
named (`nodeNames`, one pod per node); every node must then give it as many GPUs, since one pod
template serves them all. The GPU index after the node is not carried over: the device plugin picks
which of the node's GPUs a pod gets.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from rolefleet.common.config import RoleFleetConfig
from rolefleet.trainer.nodes import GROUP_ROLES

HOSTNAME_LABEL = "kubernetes.io/hostname"
# A Kubernetes label value: what a nodeSelector can match a node's hostname label against.
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")


def _role_nodes(cfg: RoleFleetConfig, role: str) -> list[str]:
    """The nodes `devices.<role>` names, in order; [] when it names none."""
    nodes = [node for node, _ in cfg.devices.by_node(role) if node is not None]
    for node in nodes:
        if not _LABEL_VALUE.match(node):
            raise ValueError(f"devices.{role}: node {node!r} cannot be matched against the {HOSTNAME_LABEL} label "
                             "(63 characters at most, starting and ending with a letter or digit)")
    return nodes


def _placement(cfg: RoleFleetConfig, role: str) -> dict[str, Any]:
    """One role's values: its pod's GPUs, and its node (nodeSelector) or nodes (a pod on each)."""
    by_node = cfg.devices.by_node(role)
    nodes = _role_nodes(cfg, role)
    if len(nodes) <= 1:
        values: dict[str, Any] = {"gpus": len(getattr(cfg.devices, role))}
        if nodes:
            values["nodeSelector"] = {HOSTNAME_LABEL: nodes[0]}
        spans = getattr(getattr(cfg, role), "nodes", None) or 1  # CPU trainers: <role>.nodes pods
        return values | ({"nodes": spans} if spans > 1 else {})
    if role not in GROUP_ROLES:  # the config refuses it already; a pod runs on one node
        raise ValueError(f"devices.{role}: entries on nodes {', '.join(nodes)}: the {role} role runs in one pod, "
                         "on one node")
    counts = {node: len(gpus) for node, gpus in by_node}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{node}: {n}" for node, n in counts.items())
        raise ValueError(f"devices.{role}: its nodes list different GPU counts ({listed}); the chart runs every "
                         "node of a role from one pod template, so give each node as many GPUs")
    return {"gpus": counts[nodes[0]], "nodes": len(nodes), "nodeNames": nodes}


def values_for(cfg: RoleFleetConfig) -> dict[str, Any]:
    """Chart values placing the run's GPU roles: `{role: {gpus, nodeSelector? | nodes, nodeNames}}`
    for actor, reward and (when the algorithm uses one) critic, plus ReadWriteMany output storage
    when the roles span several nodes (every pod mounts the output volume)."""
    values: dict[str, Any] = {}
    nodes: set[str] = set()
    for role in cfg.roles():
        if role == "coordinator":  # it holds no GPU and may run anywhere
            continue
        values[role] = _placement(cfg, role)
        nodes.update(_role_nodes(cfg, role))
    if len(nodes) > 1 or any(v.get("nodes", 1) > 1 for v in values.values()):
        values["persistence"] = {"accessModes": ["ReadWriteMany"]}
    return values


def render_values(cfg: RoleFleetConfig) -> str:
    """`values_for(cfg)` as a values file for `helm install -f`."""
    header = (f"# Placement of run {cfg.run.name}'s roles for the rolefleet Helm chart, from its devices map.\n"
              "# Install with the same config: --set-file config=CONFIG -f THIS_FILE\n")
    return header + yaml.safe_dump(values_for(cfg), sort_keys=False)

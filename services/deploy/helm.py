"""Chart values (deploy/helm/rolefleet) from a run config's devices map.

`values_for(cfg)` gives each role of the run its pod's GPU count (the number of entries in
`devices.<role>`, as `rolefleet serve` checks it) and, for `"node:i"` entries, a nodeSelector on
`kubernetes.io/hostname`: the chart, not `rolefleet up`, places roles on nodes. A pod runs on one
node, so a role whose entries name two nodes is an error. The GPU index after the node is not
carried over: the device plugin picks which of the node's GPUs a pod gets.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from rolefleet.common.config import RoleFleetConfig, split_device

HOSTNAME_LABEL = "kubernetes.io/hostname"
# A Kubernetes label value: what a nodeSelector can match a node's hostname label against.
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")


def _role_node(cfg: RoleFleetConfig, role: str) -> str | None:
    """The node named by `devices.<role>`'s entries, or None when they name none."""
    nodes = sorted({node for node, _ in map(split_device, getattr(cfg.devices, role)) if node is not None})
    if len(nodes) > 1:
        raise ValueError(f"devices.{role}: entries on nodes {', '.join(nodes)}: a role runs in one pod, "
                         "on one node; give all of its GPUs on the same node")
    if nodes and not _LABEL_VALUE.match(nodes[0]):
        raise ValueError(f"devices.{role}: node {nodes[0]!r} cannot be matched against the "
                         f"{HOSTNAME_LABEL} label (63 characters at most, starting and ending with a "
                         "letter or digit)")
    return nodes[0] if nodes else None


def values_for(cfg: RoleFleetConfig) -> dict[str, Any]:
    """Chart values placing the run's GPU roles: `{role: {gpus, nodeSelector?}}` for actor, reward
    and (when the algorithm uses one) critic, plus ReadWriteMany output storage when the roles span
    several nodes (every pod mounts the output volume)."""
    values: dict[str, Any] = {}
    nodes = set()
    for role in cfg.roles():
        if role == "coordinator":  # it holds no GPU and may run anywhere
            continue
        role_values: dict[str, Any] = {"gpus": len(getattr(cfg.devices, role))}
        node = _role_node(cfg, role)
        if node is not None:
            role_values["nodeSelector"] = {HOSTNAME_LABEL: node}
            nodes.add(node)
        values[role] = role_values
    if len(nodes) > 1:
        values["persistence"] = {"accessModes": ["ReadWriteMany"]}
    return values


def render_values(cfg: RoleFleetConfig) -> str:
    """`values_for(cfg)` as a values file for `helm install -f`."""
    header = (f"# Placement of run {cfg.run.name}'s roles for the rolefleet Helm chart, from its devices map.\n"
              "# Install with the same config: --set-file config=CONFIG -f THIS_FILE\n")
    return header + yaml.safe_dump(values_for(cfg), sort_keys=False)

"""Chart values (deploy/helm/rolefleet) from a run config: placement from its devices map, each
role's CPU and memory requests, and the runs volume's size for its checkpoints.

`placement_values(cfg)` gives each role of the run its pod's GPU count (the number of entries in
`devices.<role>`, as `rolefleet serve` checks it) and, for `"node:i"` entries, a nodeSelector on
`kubernetes.io/hostname`. A trainer (actor, critic) whose entries name several nodes spans them:
one pod per node (`nodes`, the chart's StatefulSet), each with that node's GPU count, on the nodes
named (`nodeNames`, one pod per node); every node must then give it as many GPUs, since one pod
template serves them all. The GPU index after the node is not carried over: the device plugin picks
which of the node's GPUs a pod gets.

`values_for(cfg)` adds to it every role's `resources.requests`, `snapshots.enabled` as the config's
`checkpoint.snapshot.enabled` and, where the trainers' models are readable here, `persistence.size`,
`persistence.checkpointSize` and `snapshots.sizeLimit` (deploy/sizing.py says how each is
estimated); the chart refuses a `persistence.size` below what the checkpoints need.

`input_values(cfg)` gives each role the paths, inside its pod, of every model and file it reads
(`rolefleet.deploy.inputs`): models live in ./models, which the chart's model volume holds and
mounts at /models; every other file (data, eval, reward and environment code) in ./inputs, which the
inputs volume holds and mounts at /inputs. They become `<role>.inputArgs`, overrides the chart puts
on the role's command line before its extraArgs. `render_values(cfg)` writes both.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from rolefleet.app.placement import require_map
from rolefleet.common.config import RoleFleetConfig
from rolefleet.deploy import sizing
from rolefleet.deploy.inputs import (
    HOST_INPUTS_DIR,
    HOST_MODELS_DIR,
    INPUTS_DIR,
    MODELS_DIR,
    Input,
    mounted_path,
    path_overrides,
    role_inputs,
)
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


def placement_values(cfg: RoleFleetConfig) -> dict[str, Any]:
    """Chart values placing the run's GPU roles: `{role: {gpus, nodeSelector? | nodes, nodeNames}}`
    for actor, reward and (when the algorithm uses one) critic, plus ReadWriteMany output storage
    when the roles span several nodes (every pod mounts the output volume). Raises ValueError for
    `devices: auto`."""
    require_map(cfg, "the chart's placement")
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


def storage_values(cfg: RoleFleetConfig) -> dict[str, str]:
    """`persistence.size` that holds the run's checkpoints and logs, and `checkpointSize` (one
    checkpoint, rounded up to whole GiB) that the chart checks the size against; {} when a
    trainer's model is not readable here or the run saves no checkpoint."""
    checkpoint = sizing.checkpoint_bytes(cfg)
    if not checkpoint:
        return {}
    one = math.ceil(checkpoint / sizing.GIB) * sizing.GIB  # whole GiB, as the chart checks it
    return {"size": sizing.gib(sizing.volume_bytes(one, cfg.checkpoint.keep)), "checkpointSize": sizing.gib(one)}


def snapshot_values(cfg: RoleFleetConfig) -> dict[str, Any]:
    """`snapshots.enabled` as the config has it (the chart refuses a value that differs) and, when
    on, `sizeLimit`: the fullest trainer pod's snapshot volume, in whole GiB; no sizeLimit when a
    trainer's model is not readable here (the chart's default stands)."""
    if not cfg.checkpoint.snapshot.enabled:
        return {"enabled": False}
    sizes = [sizing.snapshot_bytes(cfg, role) for role in sizing.TRAINERS if role in cfg.roles()]
    if not sizes or None in sizes:
        return {"enabled": True}
    return {"enabled": True, "sizeLimit": sizing.gib(max(sizes))}


def values_for(cfg: RoleFleetConfig) -> dict[str, Any]:
    """The chart values of the run: its placement, every role's CPU and memory requests, the runs
    volume's size and the snapshot volume's."""
    values = placement_values(cfg)
    persistence = values.pop("persistence", {}) | storage_values(cfg)
    for role, requests in sizing.requests(cfg).items():
        values.setdefault(role, {})["resources"] = {"requests": requests}
    return values | ({"persistence": persistence} if persistence else {}) | {"snapshots": snapshot_values(cfg)}


def pod_path(item: Input) -> str:
    """Where a role's pod reads `item`: a model on the model volume (./models copied onto it) at
    /models, any other file on the inputs volume (./inputs) at /inputs. The image reads no hub and
    the pods see nothing else of this machine, so anything outside is refused here, not at start."""
    host, mount, volume = ((HOST_MODELS_DIR, MODELS_DIR, "model") if item.kind == "model" else
                           (HOST_INPUTS_DIR, INPUTS_DIR, "inputs"))
    inside = mounted_path(item.path, host, mount)
    if inside is None:
        what = "model" if item.kind == "model" else "file"
        raise ValueError(f"{item.key}: {item.path!r} is outside ./{host}, and the chart's pods see a {what} only on its "
                         f"{volume} volume (mounted read-only at {mount}): put it under ./{host}, copied onto the "
                         f"volume that {volume}.existingClaim or {volume}.hostPath names, and name it "
                         f"{host}/<its path there> in the config (or as an override: {item.key}={host}/...)")
    return inside


def input_values(cfg: RoleFleetConfig) -> dict[str, Any]:
    """`{role: {inputArgs: [...]}}`: the overrides that point every model and file each role of the
    run reads at its path in the pod, and `model.path` emptied: these name every model of the run,
    per role, so the chart's one model.model_name_or_path would only be overridden by them (the chart
    refuses the two together rather than ignore one)."""
    values: dict[str, Any] = {}
    for role in cfg.roles():
        inside = {item.key: pod_path(item) for item in role_inputs(cfg, role)}
        values[role] = {"inputArgs": path_overrides(cfg, inside)}
    return values | {"model": {"path": ""}}


def chart_values(cfg: RoleFleetConfig) -> dict[str, Any]:
    """`values_for(cfg)` and `input_values(cfg)` in one values mapping: what helm-values writes."""
    values = values_for(cfg)
    for key, more in input_values(cfg).items():
        values[key] = {**values.get(key, {}), **more}
    return values


def _unsized(cfg: RoleFleetConfig, values: dict[str, Any]) -> list[str]:
    """Comment lines naming what was left to the chart's defaults, and why."""
    lines = [f"# {role}: no memory request estimated (its model's config.json is not readable here): the chart's "
             "default stands" for role in cfg.roles() if "memory" not in values[role]["resources"]["requests"]]
    if "checkpointSize" not in values.get("persistence", {}) and sizing.checkpoint_bytes(cfg) is None:
        lines.append("# persistence.size: not estimated (a trainer's config.json is not readable here): size it "
                     "as docs/deploy-kubernetes.md says")
    if values["snapshots"]["enabled"] and "sizeLimit" not in values["snapshots"]:
        lines.append("# snapshots.sizeLimit: not estimated (a trainer's config.json is not readable here): the "
                     "chart's default stands; size it as docs/deploy-kubernetes.md says")
    return lines


def render_values(cfg: RoleFleetConfig) -> str:
    """`chart_values(cfg)` as a values file for `helm install -f`."""
    values = chart_values(cfg)
    header = [f"# Placement, resource requests, volumes (runs, snapshots) and input paths of run {cfg.run.name} for "
              "the rolefleet Helm chart.",
              "# Install with the same config: --set-file config=CONFIG -f THIS_FILE, and the volumes that hold "
              f"./{HOST_MODELS_DIR} (model.existingClaim or model.hostPath, at {MODELS_DIR})",
              f"# and ./{HOST_INPUTS_DIR} (inputs.existingClaim or inputs.hostPath, at {INPUTS_DIR}); "
              "<role>.inputArgs point each role there.",
              *_unsized(cfg, values)]
    return "\n".join(header) + "\n" + yaml.safe_dump(values, sort_keys=False)

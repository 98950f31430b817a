"""The chart for roles that span nodes: a 2-node actor and a 4-node run render one StatefulSet per
spanning role (a pod per node, its GPUs, the devices map's nodes) with a headless Service for the
rendezvous, pass the Kubernetes schemas strictly, and their arguments are what `rolefleet serve`
needs on every pod. Each spanning role's NetworkPolicy keeps its group's unauthenticated ports (the
rendezvous, the agents' stores, gloo's) to its own pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from rolefleet.cli import parse_args
from rolefleet.common.config import load_config, parse_config
from rolefleet.deploy.helm import HOSTNAME_LABEL, render_values
from rolefleet.serve import node_rank_of
from rolefleet.trainer.nodes import layout_for
from tests.deploy.test_helm import (
    KUBE_VERSIONS,
    MODEL_VOLUME,
    PREFIX,
    default_config,
    failure,
    find,
    names,
    render,
    write,
)

pytestmark = [pytest.mark.procs, pytest.mark.multinode]


def two_node_actor() -> dict[str, Any]:
    """The actor on node0 and node1 with 4 GPUs each, generating on node1's; reward and critic on node2."""
    raw = default_config()
    raw["devices"] = {"actor": [f"node{n}:{i}" for n in (0, 1) for i in range(4)],
                      "rollout": [f"node1:{i}" for i in range(4)],
                      "reward": ["node2:0", "node2:1"], "critic": [f"node2:{i}" for i in range(2, 8)]}
    return raw


def four_node_run() -> dict[str, Any]:
    """A 4-node run: the actor over node0-1 (8 GPUs each, rollout on node1), the critic over node2-3
    (4 each), the reward on node3's other GPUs."""
    raw = default_config()
    raw["devices"] = {"actor": [f"node{n}:{i}" for n in (0, 1) for i in range(8)],
                      "rollout": [f"node1:{i}" for i in range(8)],
                      "critic": [f"node{n}:{i}" for n in (2, 3) for i in range(4)],
                      "reward": [f"node3:{i}" for i in range(4, 8)]}
    return raw


def rendered(tmp_path: Path, raw: dict) -> list[dict]:
    config = write(tmp_path / "run.yaml", raw)
    values = write(tmp_path / "placement.yaml", render_values(parse_config(raw)))
    return render("--set-file", f"config={config}", "-f", str(values), *MODEL_VOLUME)


def validate(docs: list[dict]) -> None:
    for doc in docs:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} against Kubernetes {version}: "
                            f"{'.'.join(map(str, e.path))}: {e.message}")


def check_spanning_role(docs: list[dict], raw: dict, role: str, nodes: list[str], gpus: int, tmp_path: Path) -> None:
    name = f"{PREFIX}-{role}"
    assert ("Deployment", name) not in names(docs)
    sts = find(docs, "StatefulSet", name)["spec"]
    assert (sts["replicas"], sts["serviceName"], sts["podManagementPolicy"]) == (len(nodes), f"{name}-nodes", "Parallel")
    labels = sts["template"]["metadata"]["labels"]
    assert sts["selector"]["matchLabels"].items() <= labels.items()
    spec = sts["template"]["spec"]
    (c,) = spec["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus  # each pod: one node's GPUs
    # One pod per node, on the devices map's nodes.
    affinity = spec["affinity"]
    [term] = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": HOSTNAME_LABEL, "operator": "In", "values": nodes}]
    [anti] = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == {"topologyKey": HOSTNAME_LABEL, "labelSelector": {"matchLabels": sts["selector"]["matchLabels"]}}
    # The headless Service: every pod, published before ready, the rendezvous port.
    headless = find(docs, "Service", f"{name}-nodes")["spec"]
    assert (headless["clusterIP"], headless["publishNotReadyAddresses"]) == ("None", True)
    assert headless["selector"] == sts["selector"]["matchLabels"]
    assert headless["ports"] == [{"name": "rendezvous", "port": 29500, "targetPort": "rendezvous", "protocol": "TCP"}]
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in c["ports"]
    # The role's Service (what the coordinator dials) reaches the first pod alone: rank 0 serves gRPC.
    service = find(docs, "Service", name)["spec"]
    assert service["selector"] == {**sts["selector"]["matchLabels"], "statefulset.kubernetes.io/pod-name": f"{name}-0"}
    # Every pod's probes ask rank 0's gRPC health on the first pod.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][3] == f"{name}-0.{name}-nodes:{service['ports'][0]['port']}"
    env = {e["name"]: e for e in c["env"]}
    assert env["ROLEFLEET_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The arguments load as the config every pod serves: the same layout, the first pod's rendezvous.
    config = write(tmp_path / f"{role}.yaml", find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    args = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in c["args"]])
    cfg = load_config(args.config, args.overrides)
    section = getattr(cfg, role)
    assert (section.rendezvous.host, section.rendezvous.port) == (f"{name}-0.{name}-nodes", 29500)
    assert layout_for(role, cfg).counts == (gpus,) * len(nodes)
    assert [node_rank_of(None, {"ROLEFLEET_POD_NAME": f"{name}-{k}"}) for k in range(len(nodes))] == list(
        range(len(nodes)))


def test_a_two_node_actor_is_one_statefulset_with_a_pod_per_node(tmp_path):
    raw = two_node_actor()
    docs = rendered(tmp_path, raw)
    validate(docs)
    check_spanning_role(docs, raw, "actor", ["node0", "node1"], 4, tmp_path)
    assert ("Deployment", f"{PREFIX}-critic") in names(docs) and ("Deployment", f"{PREFIX}-reward") in names(docs)
    assert ("Service", f"{PREFIX}-critic-nodes") not in names(docs)
    coordinator = find(docs, "Job", f"{PREFIX}-coordinator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"actor.address={PREFIX}-actor:50051" in coordinator
    assert find(docs, "PersistentVolumeClaim", f"{PREFIX}-runs")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_four_node_run_spans_the_actor_and_the_critic(tmp_path):
    raw = four_node_run()
    docs = rendered(tmp_path, raw)
    validate(docs)
    check_spanning_role(docs, raw, "actor", ["node0", "node1"], 8, tmp_path)
    check_spanning_role(docs, raw, "critic", ["node2", "node3"], 4, tmp_path)
    reward = find(docs, "Deployment", f"{PREFIX}-reward")["spec"]["template"]["spec"]
    assert reward["nodeSelector"] == {HOSTNAME_LABEL: "node3"}
    assert len([d for d in docs if d["kind"] == "StatefulSet"]) == 2


def test_a_cpu_role_over_nodes_and_tls_probes(tmp_path):
    """`<role>.nodes` of a CPU run spans pods too (no node names: any nodes, one pod each); with TLS
    the probe checks the first pod's certificate against the role's Service name."""
    raw = default_config() | {"algorithm": "grpo"}
    raw["devices"] = {}
    raw["actor"] = raw["actor"] | {"workers": 4, "nodes": 2}
    docs = render("--set-file", f"config={write(tmp_path / 'run.yaml', raw)}", "--set", "security.tls.secret=t")
    validate(docs)
    sts = find(docs, "StatefulSet", f"{PREFIX}-actor")["spec"]
    assert sts["replicas"] == 2 and "nodeAffinity" not in sts["template"]["spec"]["affinity"]
    command = sts["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert command[command.index("--server-name") + 1] == f"{PREFIX}-actor"


def test_spanning_values_that_contradict_the_config_are_refused(tmp_path):
    config = write(tmp_path / "run.yaml", two_node_actor())
    assert "actor.nodes is 3 but the run config places actor on 2 node(s)" in failure(
        "--set-file", f"config={config}", "--set", "actor.nodes=3")
    assert "actor.gpus is 8 but devices.actor of the run config lists 4 GPUs per node" in failure(
        "--set-file", f"config={config}", "--set", "actor.gpus=8")
    uneven = two_node_actor()
    uneven["devices"]["actor"] = uneven["devices"]["actor"][:-1]
    uneven["devices"]["rollout"] = ["node1:0"]
    message = failure("--set-file", f"config={write(tmp_path / 'uneven.yaml', uneven)}")
    assert "devices.actor: node node0 lists 4 GPUs and node node1 3" in message
    assert "/actor/nodeNames/0': '_bad' does not match pattern" in failure(
        "--set-file", f"config={config}", "--set", "actor.nodeNames={_bad}")


# --- the NetworkPolicy of a spanning role -----------------------------------------------------------

NAMESPACE = "ml"  # render()'s


def policies(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}


def pod_labels(docs: list[dict], kind: str, name: str) -> dict[str, str]:
    return find(docs, kind, name)["spec"]["template"]["metadata"]["labels"]


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the chart writes, so what this reads
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, namespace: str, labels: dict[str, str]) -> bool:
    """NetworkPolicyPeer semantics for label selectors: a podSelector alone means the policy's own
    namespace; a namespaceSelector alone, every pod of the namespaces it matches."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    in_namespace = _matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer \
        else namespace == NAMESPACE
    return in_namespace and ("podSelector" not in peer or _matches(peer["podSelector"], labels))


def admits(spec: dict, port: int, labels: dict[str, str], namespace: str = NAMESPACE) -> bool:
    """Whether the policy lets a TCP connection to `port` in from a pod with `labels` in `namespace`:
    some rule admits both the peer (no `from`: anyone) and the port (no `ports`, or an entry without
    a port: every port of its protocol)."""
    assert spec["policyTypes"] == ["Ingress"]
    for rule in spec.get("ingress", []):
        peers = rule.get("from") or [{"namespaceSelector": {}}]
        ports = rule.get("ports") or [{"protocol": "TCP"}]
        if any(_peer_admits(p, namespace, labels) for p in peers) and any(
                p.get("protocol", "TCP") == "TCP" and p.get("port", port) == port for p in ports):
            return True
    return False


def test_a_spanning_role_takes_its_group_from_its_own_pods_and_grpc_from_the_release(tmp_path):
    docs = rendered(tmp_path, two_node_actor())
    validate(docs)
    name = f"{PREFIX}-actor"
    assert list(policies(docs)) == [name]  # the critic and the reward run on one node each: no policy
    spec = policies(docs)[name]
    actor = pod_labels(docs, "StatefulSet", name)
    assert _matches(spec["podSelector"], actor)
    for role in ("critic", "reward"):
        assert not _matches(spec["podSelector"], pod_labels(docs, "Deployment", f"{PREFIX}-{role}"))
    coordinator = pod_labels(docs, "Job", f"{PREFIX}-coordinator")
    critic = pod_labels(docs, "Deployment", f"{PREFIX}-critic")
    other_release = actor | {"app.kubernetes.io/instance": "run2"}
    # The group's own pods, on any port: the rendezvous, the agents' stores, gloo's random ports.
    for port in (29500, 50051, 9101, 41234, 61000):
        assert admits(spec, port, actor), port
    # The release's pods (the coordinator dials it) on gRPC alone, not on the group's ports.
    assert admits(spec, 50051, coordinator) and admits(spec, 50051, critic)
    for port in (29500, 41234):
        assert not admits(spec, port, coordinator) and not admits(spec, port, critic)
    # Another release's actor, a stranger, another namespace: nothing but /metrics.
    for labels, namespace in ((other_release, NAMESPACE), ({}, NAMESPACE), (actor, "elsewhere")):
        assert [p for p in (29500, 50051, 41234, 9101) if admits(spec, p, labels, namespace)] == [9101]


def test_each_spanning_role_is_confined_to_its_own_group(tmp_path):
    docs = rendered(tmp_path, four_node_run())
    validate(docs)
    found = policies(docs)
    assert set(found) == {f"{PREFIX}-actor", f"{PREFIX}-critic"}
    actor, critic = (pod_labels(docs, "StatefulSet", f"{PREFIX}-{role}") for role in ("actor", "critic"))
    assert admits(found[f"{PREFIX}-critic"], 41234, critic) and not admits(found[f"{PREFIX}-critic"], 41234, actor)
    assert admits(found[f"{PREFIX}-actor"], 29500, actor) and not admits(found[f"{PREFIX}-actor"], 29500, critic)
    assert admits(found[f"{PREFIX}-critic"], 50053, actor)  # gRPC: any pod of the release


def test_the_metrics_port_can_be_kept_to_a_monitoring_namespace(tmp_path):
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    config = write(tmp_path / "run.yaml", two_node_actor())
    docs = render("--set-file", f"config={config}", *MODEL_VOLUME,
                  "--set-json", f"networkPolicy.metricsFrom={json.dumps(monitoring)}")
    validate(docs)
    spec = policies(docs)[f"{PREFIX}-actor"]
    assert admits(spec, 9101, {"app": "prometheus"}, "monitoring")
    assert not admits(spec, 9101, {}, NAMESPACE) and not admits(spec, 29500, {}, "monitoring")


def test_no_policy_when_disabled_or_on_one_node(tmp_path):
    config = write(tmp_path / "run.yaml", two_node_actor())
    assert not policies(render("--set-file", f"config={config}", *MODEL_VOLUME, "--set", "networkPolicy.enabled=false"))
    assert find(render("--set-file", f"config={config}", *MODEL_VOLUME, "--set", "networkPolicy.enabled=false"),
                "StatefulSet", f"{PREFIX}-actor")  # the role still spans
    assert not policies(render())  # the default: every role on one node
    assert "networkPolicy/metricsFrom" in failure("--set", "networkPolicy.metricsFrom=everyone")

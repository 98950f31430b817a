"""The Helm chart (deploy/helm/rolefleet), rendered by the real helm and checked against the
Kubernetes API schemas, and the placement values `rolefleet.deploy.helm` derives from a devices map."""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rolefleet.algos.presets import ALGORITHMS
from rolefleet.certs import make_certs
from rolefleet.cli import parse_args
from rolefleet.common.config import load_config, parse_config
from rolefleet.deploy.helm import HOSTNAME_LABEL, chart_values, placement_values, render_values, values_for
from tests.deploy.tools import REPO, healthcheck, mutual_tls_health_server, tool

pytestmark = pytest.mark.procs

CHART = REPO / "deploy" / "helm" / "rolefleet"
DOC = REPO / "docs" / "deploy-kubernetes.md"
RELEASE = "run1"
PREFIX = f"{RELEASE}-rolefleet"
# The chart's floor (Chart.yaml kubeVersion: native gRPC probes) and the newest schemas shipped.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
# Custom resources have no schema among the Kubernetes API's: skipped by name, nothing else is.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
GRPC_PORTS = {"coordinator": 50050, "actor": 50051, "reward": 50052, "critic": 50053}
METRICS_PORTS = {"coordinator": 9100, "actor": 9101, "reward": 9102, "critic": 9103}
# helm-values points every role at its models on the model volume, which the chart then requires.
MODEL_VOLUME = ("--set", "model.existingClaim=models")


def default_config() -> dict[str, Any]:
    return yaml.safe_load(yaml.safe_load((CHART / "values.yaml").read_text())["config"])


def two_node_config() -> dict[str, Any]:
    raw = default_config()
    raw["devices"] = {"actor": ["node0:0", "node0:1", "node0:2", "node0:3"], "rollout": ["node0:0", "node0:1"],
                      "reward": ["node1:0", "node1:1"], "critic": ["node1:2", "node1:3", "node1:4"]}
    return raw


def write(path: Path, data: Any) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60)


def render(*args: str) -> list[dict[str, Any]]:
    """Every manifest `helm template` renders for the chart with `args` (-f, --set, ...)."""
    done = helm("template", RELEASE, str(CHART), "--namespace", "ml", *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def failure(*args: str) -> str:
    """helm template's error for `args`, which must not render."""
    done = helm("template", RELEASE, str(CHART), *args)
    assert done.returncode != 0, f"rendered although it should not: {args}"
    return done.stderr


def find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered; have {names(docs)}"
    return found[0]


def names(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def workload(docs: list[dict], role: str) -> dict:
    return find(docs, "Job" if role == "coordinator" else "Deployment", f"{PREFIX}-{role}")


def pod(docs: list[dict], role: str) -> dict:
    return workload(docs, role)["spec"]["template"]["spec"]


def container(docs: list[dict], role: str) -> dict:
    (only,) = pod(docs, role)["containers"]
    return only


def env(docs: list[dict], role: str) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(docs, role).get("env", [])}


def gpu_limit(docs: list[dict], role: str) -> int | None:
    return container(docs, role).get("resources", {}).get("limits", {}).get("nvidia.com/gpu")


def overrides(docs: list[dict], role: str) -> dict[str, str]:
    return dict(a.split("=", 1) for a in container(docs, role)["args"] if "=" in a)


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def placement(tmp_path_factory) -> tuple[dict, list[dict]]:
    """The two-node run: its values from values_for, rendered with its config as the chart's."""
    tmp = tmp_path_factory.mktemp("placement")
    raw = two_node_config()
    config = write(tmp / "run.yaml", raw)
    values = write(tmp / "placement.yaml", render_values(parse_config(raw)))
    return raw, render("--set-file", f"config={config}", "-f", str(values), *MODEL_VOLUME)


# --- lint and schemas ---------------------------------------------------------------------------

def test_lint_passes_strict_with_default_and_two_node_values(tmp_path):
    raw = two_node_config()
    config = write(tmp_path / "run.yaml", raw)
    values = write(tmp_path / "placement.yaml", render_values(parse_config(raw)))
    for args in ([], ["--set-file", f"config={config}", "-f", str(values)],
                 ["--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
                  "--set", "monitoring.dashboards.enabled=true", "--set", "persistence.checkpointSize=10Gi"], SECURED):
        done = helm("lint", "--strict", str(CHART), *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "0 chart(s) failed" in done.stdout


VARIANTS = {
    "default": [],
    "service monitor, rules, dashboards, 3 reward replicas": [
        "--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
        "--set", "monitoring.dashboards.enabled=true", "--set", "reward.replicas=3"],
    "model hostPath, no persistence, NodePort": ["--set", "model.hostPath=/data/models", "--set",
                                                 "persistence.enabled=false", "--set", "coordinator.service.type=NodePort"],
    "model claim, existing output claim, no SA": ["--set", "model.existingClaim=models", "--set",
                                                  "persistence.existingClaim=runs", "--set", "serviceAccount.create=false"],
    "mutual TLS and a token": ["--set", "security.tls.secret=run1-tls", "--set", "security.tls.mutual=true",
                               "--set", "security.tokenSecret=run1-token"],
    "resources, tolerations, affinity": [
        "--set", "actor.resources.requests.cpu=8", "--set", "actor.resources.limits.memory=128Gi",
        "--set-json", 'tolerations=[{"key":"nvidia.com/gpu","operator":"Exists","effect":"NoSchedule"}]',
        "--set-json", 'affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":'
                      '[{"matchExpressions":[{"key":"gpu","operator":"In","values":["h200"]}]}]}}}',
        "--set", "coordinator.activeDeadlineSeconds=86400", "--set", "persistence.storageClass=-"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_validates_against_the_kubernetes_schemas(variant):
    docs = render(*VARIANTS[variant])
    skipped = []
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            skipped.append(doc["kind"])
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(map(str, e.path))
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} against Kubernetes {version}: {path}: {e.message}")
    assert sorted(skipped) == (["PrometheusRule", "ServiceMonitor"] if "service monitor" in variant else [])


def test_placement_manifests_validate(placement):
    assert placement[1]  # validate() raises on the first manifest outside the schema
    for doc in placement[1]:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


# --- the default install ------------------------------------------------------------------------

def test_default_renders_one_workload_per_role_and_their_services(default_docs):
    assert names(default_docs) == {
        ("ServiceAccount", PREFIX), ("ConfigMap", f"{PREFIX}-config"), ("PersistentVolumeClaim", f"{PREFIX}-runs"),
        ("Secret", f"{PREFIX}-token"),
        *{("Deployment", f"{PREFIX}-{r}") for r in ("actor", "reward", "critic")},
        ("Job", f"{PREFIX}-coordinator"),
        *{("Service", f"{PREFIX}-{r}") for r in GRPC_PORTS}, ("Service", f"{PREFIX}-reward-headless"),
    }


def test_default_config_is_configs_8gpu_with_in_pod_paths(default_docs):
    shipped = yaml.safe_load((REPO / "configs" / "8gpu.yaml").read_text())
    config = yaml.safe_load(find(default_docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    assert config["model"] == {"model_name_or_path": "/models/policy"}
    assert shipped["run"].pop("output_dir") == "runs/8gpu"  # the chart sets it to the output volume
    assert {k: v for k, v in config.items() if k != "model"} == {k: v for k, v in shipped.items() if k != "model"}


def test_default_gpu_limits_follow_the_devices_map(default_docs):
    devices = default_config()["devices"]
    for role in ("actor", "reward", "critic"):
        gpus = len(devices.get(role, []))
        assert gpu_limit(default_docs, role) == (gpus or None)
        if gpus:
            assert "CUDA_VISIBLE_DEVICES" not in env(default_docs, role)  # the device plugin chooses
        else:
            assert env(default_docs, role)["CUDA_VISIBLE_DEVICES"] == ""
    assert gpu_limit(default_docs, "coordinator") is None
    # A pod without a GPU request must not see the node's GPUs through a CUDA image's defaults.
    assert env(default_docs, "coordinator")["CUDA_VISIBLE_DEVICES"] == ""
    assert env(default_docs, "coordinator")["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_each_role_binds_all_interfaces_on_its_fixed_ports(default_docs):
    for role, port in GRPC_PORTS.items():
        c = container(default_docs, role)
        assert c["command"] == ["rolefleet"]
        assert c["args"][2:6] == ["serve", role, "--config", "/etc/rolefleet/config.yaml"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == (
            {"grpc": port, "metrics": METRICS_PORTS[role]} | ({"http": 8080} if role == "coordinator" else {})
            | ({"endpoint": 8300} if role == "actor" else {}))
        o = overrides(default_docs, role)
        assert (o[f"{role}.host"], o[f"{role}.port"], o[f"{role}.metrics_port"]) == (
            "0.0.0.0", str(port), str(METRICS_PORTS[role]))
        assert o["run.output_dir"] == "/runs/8gpu"
        assert o["model.model_name_or_path"] == "/models/policy"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/runs"] == "runs" and mounts["/etc/rolefleet"] == "config"


def test_coordinator_dials_the_role_services(default_docs):
    o = overrides(default_docs, "coordinator")
    assert o["actor.address"] == f"{PREFIX}-actor:50051"
    assert o["reward.address"] == f"{PREFIX}-reward-headless:50052"
    assert o["critic.address"] == f"{PREFIX}-critic:50053"
    assert (o["coordinator.http_enabled"], o["coordinator.http_host"], o["coordinator.http_port"]) == (
        "true", "0.0.0.0", "8080")
    for role in ("actor", "reward", "critic"):  # only the coordinator dials
        assert not any(k.endswith(".address") for k in overrides(default_docs, role))
    service = find(default_docs, "Service", f"{PREFIX}-coordinator")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50050, "metrics": 9100, "http": 8080}


@pytest.mark.parametrize("role", list(GRPC_PORTS))
def test_rendered_arguments_are_a_valid_serve_command_and_config(tmp_path, role):
    """The container's argv parses as `rolefleet serve` and its overrides load with the config."""
    docs = render()
    config = write(tmp_path / "config.yaml", find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    args = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in container(docs, role)["args"]])
    assert (args.command, args.role, args.config) == ("serve", role, str(config))
    cfg = load_config(args.config, args.overrides)
    section = getattr(cfg, role)
    assert (section.host, section.port, section.metrics_port) == ("0.0.0.0", GRPC_PORTS[role], METRICS_PORTS[role])
    if role == "coordinator":
        assert cfg.train.connect_timeout_s == 3600
        assert {r: getattr(cfg, r).dial_address(r) for r in ("actor", "reward", "critic")} == {
            "actor": f"{PREFIX}-actor:50051", "reward": f"{PREFIX}-reward-headless:50052",
            "critic": f"{PREFIX}-critic:50053"}
        assert (cfg.coordinator.http_enabled, cfg.coordinator.http_host, cfg.coordinator.http_port) == (
            True, "0.0.0.0", 8080)


def test_control_plane_can_be_turned_off():
    docs = render("--set", "coordinator.http.enabled=false")
    o = overrides(docs, "coordinator")
    assert o["coordinator.http_enabled"] == "false" and "coordinator.http_port" not in o
    assert "http" not in {p["name"] for p in container(docs, "coordinator")["ports"]}
    service = find(docs, "Service", f"{PREFIX}-coordinator")
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}


def test_probes_use_the_grpc_health_service_with_a_long_startup(default_docs):
    for role, port in GRPC_PORTS.items():
        c = container(default_docs, role)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (role, probe)
        startup = c["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] >= 15 * 60  # a model load takes minutes


def test_pods_run_unprivileged_on_a_read_only_root(default_docs):
    for role in GRPC_PORTS:
        spec, c = pod(default_docs, role), container(default_docs, role)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/dev/shm"} <= mounts and env(default_docs, role)["HOME"] == "/tmp"


def test_roles_update_without_waiting_for_gpus_they_hold_themselves(default_docs):
    for role in ("actor", "critic"):
        spec = workload(default_docs, role)["spec"]
        assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    assert workload(default_docs, "reward")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    job = workload(default_docs, "coordinator")["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never" and job["backoffLimit"] == 0


def test_a_changed_config_restarts_the_roles(tmp_path, default_docs):
    raw = default_config() | {"train": {"total_steps": 5, "prompts_per_step": 8, "samples_per_prompt": 2}}
    changed = render("--set-file", f"config={write(tmp_path / 'run.yaml', raw)}")
    for role in GRPC_PORTS:
        old, new = (workload(docs, role)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                    for docs in (default_docs, changed))
        assert old != new, role


# --- algorithms, replicas, monitoring, volumes --------------------------------------------------

@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_critic_runs_only_for_algorithms_with_a_value_model(tmp_path, algorithm):
    raw = default_config() | {"algorithm": algorithm, "teacher": {"model_name_or_path": "/models/teacher"}}
    docs = render("--set-file", f"config={write(tmp_path / 'run.yaml', raw)}")
    uses_critic = "critic" in parse_config(raw).roles()
    assert ALGORITHMS[algorithm].uses_critic == uses_critic
    assert (("Deployment", f"{PREFIX}-critic") in names(docs)) == uses_critic
    assert (("Service", f"{PREFIX}-critic") in names(docs)) == uses_critic
    assert ("critic.address" in overrides(docs, "coordinator")) == uses_critic


@pytest.mark.parametrize("algorithm, distill_coef", [(a, 0.0) for a in ALGORITHMS] + [("grpo", 0.5)])
def test_the_teacher_runs_only_for_on_policy_distillation(tmp_path, algorithm, distill_coef):
    raw = default_config() | {"algorithm": algorithm, "teacher": {"model_name_or_path": "/models/teacher"},
                              "train": {**default_config().get("train", {}), "samples_per_prompt": 2,
                                        "distill_coef": distill_coef}}
    docs = render("--set-file", f"config={write(tmp_path / 'run.yaml', raw)}")
    uses_teacher = "teacher" in parse_config(raw).roles()
    assert uses_teacher == (ALGORITHMS[algorithm].uses_teacher or distill_coef > 0)
    assert (("Deployment", f"{PREFIX}-teacher") in names(docs)) == uses_teacher
    assert (("Service", f"{PREFIX}-teacher") in names(docs)) == uses_teacher
    assert ("teacher.address" in overrides(docs, "coordinator")) == uses_teacher
    if uses_teacher:
        assert overrides(docs, "coordinator")["teacher.address"] == f"{PREFIX}-teacher:50054"
        spec = workload(docs, "teacher")["spec"]
        assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})


def test_reward_replicas_and_their_headless_service(tmp_path):
    two_gpu_reward = write(tmp_path / "run.yaml", two_node_config())
    docs = render("--set-file", f"config={two_gpu_reward}", "--set", "reward.replicas=3")
    deployment = workload(docs, "reward")
    assert deployment["spec"]["replicas"] == 3
    headless = find(docs, "Service", f"{PREFIX}-reward-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert headless["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]  # metrics are scraped once, elsewhere
    assert gpu_limit(docs, "reward") == 2  # per replica
    assert overrides(docs, "coordinator")["reward.address"] == f"{PREFIX}-reward-headless:50052"


def test_service_monitor_only_when_enabled(default_docs):
    assert not [d for d in default_docs if d["kind"] == "ServiceMonitor"]
    docs = render("--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.serviceMonitor.labels.release=prom",
                  "--set", "monitoring.serviceMonitor.interval=30s")
    monitor = find(docs, "ServiceMonitor", PREFIX)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert monitor["spec"]["endpoints"] == [{
        "port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s", "honorLabels": True,
        # `up` gets the role label the role-down alert selects by.
        "relabelings": [{"sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_component"],
                         "targetLabel": "role"}]}]
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"
               and selector.items() <= d["metadata"]["labels"].items()
               and any(p["name"] == "metrics" for p in d["spec"]["ports"])}
    assert scraped == {f"{PREFIX}-{r}" for r in GRPC_PORTS}


def test_model_volume_is_mounted_read_only_in_every_role():
    """The coordinator too: it loads the actor model's tokenizer (chat template, data.max_prompt_tokens)
    and the image runs offline."""
    docs = render("--set", "model.hostPath=/data/models")
    for role in GRPC_PORTS:
        (mount,) = [m for m in container(docs, role)["volumeMounts"] if m["name"] == "models"]
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        (volume,) = [v for v in pod(docs, role)["volumes"] if v["name"] == "models"]
        assert volume["hostPath"] == {"path": "/data/models", "type": "Directory"}
    docs = render("--set", "model.existingClaim=models", "--set", "model.path=/models/qwen")
    for role in GRPC_PORTS:
        (volume,) = [v for v in pod(docs, role)["volumes"] if v["name"] == "models"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert overrides(docs, role)["model.model_name_or_path"] == "/models/qwen"
    assert not [v for v in pod(render(), "coordinator")["volumes"] if v["name"] == "models"]  # none set
    assert "model.model_name_or_path" not in overrides(render("--set", "model.path="), "actor")


def test_output_volume_claim_options():
    docs = render("--set", "persistence.existingClaim=shared-runs")
    assert ("PersistentVolumeClaim", f"{PREFIX}-runs") not in names(docs)
    for role in GRPC_PORTS:
        (volume,) = [v for v in pod(docs, role)["volumes"] if v["name"] == "runs"]
        assert volume["persistentVolumeClaim"] == {"claimName": "shared-runs"}
    claim = find(render("--set", "persistence.storageClass=fast", "--set", "persistence.keep=false"),
                 "PersistentVolumeClaim", f"{PREFIX}-runs")
    assert claim["spec"]["storageClassName"] == "fast" and "annotations" not in claim["metadata"]


def test_role_extra_args_come_last_and_role_values_merge_over_pod_wide_ones():
    docs = render("--set", "coordinator.extraArgs={train.total_steps=10}", "--set", "nodeSelector.pool=gpu",
                  "--set", "actor.nodeSelector.pool=big", "--set", "reward.nodeSelector.zone=a")
    assert container(docs, "coordinator")["args"][-1] == "train.total_steps=10"
    assert pod(docs, "actor")["nodeSelector"] == {"pool": "big"}
    assert pod(docs, "reward")["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert pod(docs, "coordinator")["nodeSelector"] == {"pool": "gpu"}


def notes(*args: str) -> str:
    """NOTES.txt as `helm install` prints it (a client-side dry run: no cluster)."""
    done = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", "ml", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("NOTES:", 1)[1]


def test_notes_say_how_to_follow_the_run_and_warn_without_a_model_volume():
    text = notes()
    assert f"kubectl --namespace ml logs -f job/{PREFIX}-coordinator" in text
    assert f"port-forward svc/{PREFIX}-coordinator 50050 8080" in text
    assert "rolefleet status --address 127.0.0.1:50050" in text
    assert "WARNING: no model volume is set" in text
    assert "WARNING" not in notes("--set", "model.existingClaim=models")
    assert "LOST with the pods" in notes("--set", "persistence.enabled=false")


# --- TLS and the token ---------------------------------------------------------------------------

SECURED = ["--set", "security.tls.secret=run1-tls", "--set", "security.tls.mutual=true",
           "--set", "security.tokenSecret=run1-token"]
TLS_DIR = "/etc/rolefleet/tls"


@pytest.fixture(scope="module")
def secured_docs() -> list[dict]:
    return render(*SECURED)


def test_with_a_tls_secret_each_pod_mounts_the_ca_and_its_own_pair_read_only(secured_docs):
    for role in GRPC_PORTS:
        (mount,) = [m for m in container(secured_docs, role)["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}, role
        (volume,) = [v for v in pod(secured_docs, role)["volumes"] if v["name"] == "tls"]
        # Only ca.pem and the role's own pair: not the other roles' keys, nor a CA key left in the Secret.
        assert volume == {"name": "tls", "secret": {
            "secretName": "run1-tls", "defaultMode": 0o440,
            "items": [{"key": k, "path": k} for k in ("ca.pem", f"{role}.pem", f"{role}-key.pem")]}}, role
        # The files are group-readable; the group is the pod's fsGroup, which the non-root user is in.
        assert pod(secured_docs, role)["securityContext"]["fsGroup"] == 1000


@pytest.mark.parametrize("role", list(GRPC_PORTS))
def test_with_a_tls_secret_the_serve_command_loads_the_mounted_files(tmp_path, secured_docs, role):
    args = container(secured_docs, role)["args"]
    chart = [a for a in args if a.startswith("security.")]
    assert chart == [f"security.tls.cert_file={TLS_DIR}/{{role}}.pem", f"security.tls.key_file={TLS_DIR}/{{role}}-key.pem",
                     f"security.tls.ca_file={TLS_DIR}/ca.pem", "security.tls.mutual=true",
                     "security.token_file=", "security.token_env=ROLEFLEET_TOKEN"]
    config = write(tmp_path / "config.yaml", find(secured_docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    parsed = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in args])
    cfg = load_config(parsed.config, parsed.overrides)
    assert cfg.security.tls.paths(role) == {"cert_file": f"{TLS_DIR}/{role}.pem", "key_file": f"{TLS_DIR}/{role}-key.pem",
                                            "ca_file": f"{TLS_DIR}/ca.pem"}
    assert cfg.security.tls.mutual is True and cfg.security.tls.enabled
    assert (cfg.security.token_file, cfg.security.token_env) == (None, "ROLEFLEET_TOKEN")
    # The volume holds exactly the files that config names, under the same names.
    (volume,) = [v for v in pod(secured_docs, role)["volumes"] if v["name"] == "tls"]
    assert {f"{TLS_DIR}/{i['path']}" for i in volume["secret"]["items"]} == set(cfg.security.tls.paths(role).values())


def test_with_a_token_secret_every_role_gets_it_as_rolefleet_token(secured_docs):
    for role in GRPC_PORTS:
        (token,) = [e for e in container(secured_docs, role)["env"] if e["name"] == "ROLEFLEET_TOKEN"]
        assert token == {"name": "ROLEFLEET_TOKEN", "valueFrom": {"secretKeyRef": {"name": "run1-token", "key": "token"}}}


def test_with_tls_the_probes_run_the_image_probe_over_tls_with_the_timings_of_values(secured_docs):
    timings = yaml.safe_load((CHART / "values.yaml").read_text())["probes"]
    for role, port in GRPC_PORTS.items():
        c = container(secured_docs, role)
        for kind in ("startup", "readiness", "liveness"):
            probe = c[f"{kind}Probe"]
            assert "grpc" not in probe  # native gRPC probes speak no TLS
            assert {k: v for k, v in probe.items() if k != "exec"} == timings[kind], (role, kind)
            assert probe["exec"]["command"] == [
                "python", "-m", "rolefleet.deploy.healthcheck", f"127.0.0.1:{port}",
                "--timeout", str(timings[kind]["timeoutSeconds"] - 1),  # answers before the kubelet gives up
                "--ca", f"{TLS_DIR}/ca.pem", "--cert", f"{TLS_DIR}/{role}.pem", "--key", f"{TLS_DIR}/{role}-key.pem"]
    docs = render(*SECURED, "--set", "probes.readiness.timeoutSeconds=1", "--set", "probes.liveness.periodSeconds=30")
    readiness, liveness = (container(docs, "actor")[f"{k}Probe"] for k in ("readiness", "liveness"))
    assert readiness["exec"]["command"][4:6] == ["--timeout", "1"] and readiness["timeoutSeconds"] == 1
    assert liveness["periodSeconds"] == 30


def test_the_rendered_probe_command_finds_a_mutual_tls_server_serving(tmp_path, certs, secured_docs):
    """The exec probe of the reward pod, its files at the host paths and its port at a real server's."""
    command = container(secured_docs, "reward")["readinessProbe"]["exec"]["command"]

    async def probe() -> subprocess.CompletedProcess:
        server, port = await mutual_tls_health_server(certs, "reward")
        try:
            args = [a.replace(TLS_DIR, str(certs)).replace("127.0.0.1:50052", f"127.0.0.1:{port}") for a in command[3:]]
            return await asyncio.to_thread(healthcheck, *args)
        finally:
            await server.stop(None)

    assert command[:3] == ["python", "-m", "rolefleet.deploy.healthcheck"]
    result = asyncio.run(probe())
    assert result.returncode == 0 and result.stdout.strip().endswith(": SERVING"), result.stderr


def test_tls_without_mutual_and_a_token_alone():
    docs = render("--set", "security.tls.secret=run1-tls")
    assert overrides(docs, "critic")["security.tls.mutual"] == "false"
    (token,) = [e for e in container(docs, "critic")["env"] if e["name"] == "ROLEFLEET_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["name"] == f"{PREFIX}-token"  # TLS alone lets anyone call: a token too
    docs = render("--set", "security.tokenSecret=run1-token")
    assert ("Secret", f"{PREFIX}-token") not in names(docs)  # a named Secret: the chart makes none
    for role, port in GRPC_PORTS.items():
        c = container(docs, role)
        assert not [a for a in c["args"] if a.startswith("security.tls")]
        assert "tls" not in {m["name"] for m in c["volumeMounts"]}
        assert c["readinessProbe"]["grpc"] == {"port": port}
        assert [e["name"] for e in c["env"]].count("ROLEFLEET_TOKEN") == 1


def test_by_default_the_chart_makes_a_token_secret_every_role_demands(tmp_path, default_docs):
    secret = find(default_docs, "Secret", f"{PREFIX}-token")
    # Kept by `helm uninstall`, so a reinstall (which looks it up, as every upgrade does) reuses it.
    assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    other = find(render(), "Secret", f"{PREFIX}-token")["data"]["token"]
    assert other != secret["data"]["token"]  # drawn at random (offline: no Secret to look up)
    config = write(tmp_path / "config.yaml", find(default_docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    for role in GRPC_PORTS:
        c = container(default_docs, role)
        (entry,) = [e for e in c["env"] if e["name"] == "ROLEFLEET_TOKEN"]
        assert entry["valueFrom"] == {"secretKeyRef": {"name": f"{PREFIX}-token", "key": "token"}}, role
        assert [a for a in c["args"] if a.startswith("security.")] == ["security.token_file=",
                                                                      "security.token_env=ROLEFLEET_TOKEN"]
        assert "tls" not in {v["name"] for v in pod(default_docs, role)["volumes"]}
        parsed = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in c["args"]])
        cfg = load_config(parsed.config, parsed.overrides)
        assert not cfg.security.allow_unauthenticated and cfg.security.token_env == "ROLEFLEET_TOKEN"
    text = notes()
    assert f"export ROLEFLEET_TOKEN=$(kubectl --namespace ml get secret {PREFIX}-token" in text
    assert f"Every role refuses calls without the run's token, from Secret {PREFIX}-token" in text


def test_allow_unauthenticated_renders_no_token_and_lets_the_roles_start_open(tmp_path):
    docs = render("--set", "security.allowUnauthenticated=true")
    assert not [d for d in docs if d["kind"] == "Secret"]
    config = write(tmp_path / "config.yaml", find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    for role in GRPC_PORTS:
        c = container(docs, role)
        assert "ROLEFLEET_TOKEN" not in env(docs, role)
        assert [a for a in c["args"] if a.startswith("security.")] == ["security.allow_unauthenticated=true"]
        parsed = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in c["args"]])
        assert load_config(parsed.config, parsed.overrides).security.allow_unauthenticated
    assert "refuses calls without the run's token" not in notes("--set", "security.allowUnauthenticated=true")


def test_mutual_tls_without_a_secret_is_refused():
    assert "security.tls.mutual needs security.tls.secret" in failure("--set", "security.tls.mutual=true")
    assert "security" in failure("--set", "security.tls.secret=Not_A_Name")
    assert "additional properties 'token' not allowed" in failure("--set", "security.token=abc")


def certs_command(text: str) -> list[str]:
    """The `rolefleet certs DIR --host ...` command in `text` (NOTES or the docs), as argv."""
    joined = re.sub(r"\\\n\s*", " ", text)
    (line,) = [line for line in joined.splitlines() if line.strip().startswith("rolefleet certs ")]
    return shlex.split(line)


def test_notes_with_tls_and_a_token_say_https_the_certs_and_the_token():
    text = notes(*SECURED)
    assert "rolefleet status --address 127.0.0.1:50050 --certs DIR" in text
    assert ("curl --cacert DIR/ca.pem --cert DIR/client.pem --key DIR/client-key.pem "
            '-H "Authorization: Bearer $ROLEFLEET_TOKEN" https://127.0.0.1:8080/v1/status') in text
    assert "export ROLEFLEET_TOKEN=$(kubectl --namespace ml get secret run1-token -o jsonpath='{.data.token}' | base64 -d)" in text
    assert "http://" not in text
    assert certs_command(text)[:3] == ["rolefleet", "certs", "DIR"]


def test_the_documented_certs_command_names_every_address_the_coordinator_dials(tmp_path, certs, secured_docs):
    """Certificates made by the command of NOTES and of the docs (release run1, namespace ml) pass
    gRPC's host name check for each role Service the coordinator dials, and for the probes' 127.0.0.1."""
    command = certs_command(notes(*SECURED))
    documented = certs_command(DOC.read_text())
    assert documented[3:] == command[3:], "docs/deploy-kubernetes.md's `rolefleet certs` command differs from NOTES'"
    hosts = command[4::2]
    assert command[3::2] == ["--host"] * len(hosts)
    made = tmp_path / "made"
    make_certs(made, hosts=hosts)
    dialled = {role: overrides(secured_docs, "coordinator")[f"{role}.address"].rsplit(":", 1)[0]
               for role in ("actor", "reward", "critic")}
    assert dialled["reward"] == f"{PREFIX}-reward-headless"

    async def probes() -> dict[str, subprocess.CompletedProcess]:
        results = {}
        for role, host in [*dialled.items(), ("coordinator", f"{PREFIX}-coordinator.ml.svc.cluster.local"),
                           ("actor", f"{PREFIX}-actor.ml.svc"), ("critic", "127.0.0.1")]:
            server, port = await mutual_tls_health_server(made, role)
            try:
                results[f"{role} as {host}"] = await asyncio.to_thread(
                    healthcheck, f"127.0.0.1:{port}", "--ca", str(made / "ca.pem"), "--cert",
                    str(made / "coordinator.pem"), "--key", str(made / "coordinator-key.pem"), "--server-name", host)
            finally:
                await server.stop(None)
        return results

    for case, result in asyncio.run(probes()).items():
        assert result.returncode == 0, (case, result.stderr)
    # The check is real: a name the certificates do not hold fails it.
    async def stranger() -> subprocess.CompletedProcess:
        server, port = await mutual_tls_health_server(made, "actor")
        try:
            return await asyncio.to_thread(healthcheck, f"127.0.0.1:{port}", "--ca", str(made / "ca.pem"),
                                           "--cert", str(made / "client.pem"), "--key", str(made / "client-key.pem"),
                                           "--server-name", f"{PREFIX}-actor.other.svc")
        finally:
            await server.stop(None)

    assert asyncio.run(stranger()).returncode == 1


# --- refused values -----------------------------------------------------------------------------

def test_gpu_count_that_contradicts_the_devices_map_is_refused():
    listed = len(default_config()["devices"]["actor"])
    message = failure("--set", f"actor.gpus={listed + 1}")
    assert f"actor.gpus is {listed + 1} but devices.actor of the run config lists {listed} GPUs" in message


def test_config_must_be_yaml_text():
    assert "config" in failure("--set-json", 'config={"algorithm":"grpo"}')
    assert "config must be the run config as YAML text" in failure(
        "--set-json", 'config={"algorithm":"grpo"}', "--skip-schema-validation")
    assert "config is not valid YAML" in failure("--set", "config=a: [b")


def test_misspelt_values_are_refused_by_the_schema():
    assert "additional properties 'gpu' not allowed" in failure("--set", "actor.gpu=4")
    assert "extraArgs" in failure("--set", "actor.extraArgs={--verbose}")


# --- the two-node placement from values_for -----------------------------------------------------

def test_two_node_placement_pins_each_role_to_its_node(placement):
    raw, docs = placement
    for role, node in (("actor", "node0"), ("reward", "node1"), ("critic", "node1")):
        assert pod(docs, role)["nodeSelector"] == {HOSTNAME_LABEL: node}
        assert gpu_limit(docs, role) == len(raw["devices"][role])
    assert "nodeSelector" not in pod(docs, "coordinator") and gpu_limit(docs, "coordinator") is None
    assert find(docs, "PersistentVolumeClaim", f"{PREFIX}-runs")["spec"]["accessModes"] == ["ReadWriteMany"]
    config = yaml.safe_load(find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    assert config["devices"] == raw["devices"]  # the roles' GPU count check reads the same map


# --- values_for ---------------------------------------------------------------------------------

def test_the_chart_needs_the_devices_map_and_not_auto(tmp_path):
    """`devices: auto` (a config without devices) stands for the map `rolefleet up` chooses on its
    own machine: installed as it is, every pod would run on the CPU without a word."""
    raw = {k: v for k, v in default_config().items() if k != "devices"}
    assert "config: devices is auto (the default without a devices map)" in failure(
        "--set-file", f"config={write(tmp_path / 'auto.yaml', raw)}")
    docs = render("--set-file", f"config={write(tmp_path / 'cpu.yaml', raw | {'devices': 'cpu'})}")
    assert [gpu_limit(docs, role) for role in ("actor", "reward", "critic")] == [None, None, None]


def test_placement_of_local_devices_is_gpu_counts_only():
    devices = default_config()["devices"]
    assert placement_values(parse_config(default_config())) == {
        role: {"gpus": len(devices.get(role, []))} for role in ("actor", "reward", "critic")}


def test_placement_of_node_entries():
    values = placement_values(parse_config(two_node_config()))
    assert values == {
        "actor": {"gpus": 4, "nodeSelector": {HOSTNAME_LABEL: "node0"}},
        "reward": {"gpus": 2, "nodeSelector": {HOSTNAME_LABEL: "node1"}},
        "critic": {"gpus": 3, "nodeSelector": {HOSTNAME_LABEL: "node1"}},
        "persistence": {"accessModes": ["ReadWriteMany"]},
    }


def test_placement_on_one_node_keeps_the_default_storage_and_skips_an_unused_critic():
    raw = default_config() | {"algorithm": "grpo"}
    raw["devices"] = {"actor": ["gpu-a:0", "gpu-a:1"], "reward": ["gpu-a:2"], "critic": ["gpu-b:0"]}
    assert placement_values(parse_config(raw)) == {"actor": {"gpus": 2, "nodeSelector": {HOSTNAME_LABEL: "gpu-a"}},
                                                   "reward": {"gpus": 1, "nodeSelector": {HOSTNAME_LABEL: "gpu-a"}}}


def test_placement_of_a_trainer_on_two_nodes_spans_them_and_refuses_uneven_nodes():
    raw = default_config()
    raw["devices"] = {"actor": ["node0:0", "node0:1", "node2:0", "node2:1"], "reward": ["node1:0"]}
    assert placement_values(parse_config(raw))["actor"] == {"gpus": 2, "nodes": 2, "nodeNames": ["node0", "node2"]}
    raw["devices"]["actor"] = ["node0:0", "node0:1", "node2:1"]
    with pytest.raises(ValueError, match=re.escape("devices.actor: its nodes list different GPU counts (node0: 2, "
                                                   "node2: 1)")):
        placement_values(parse_config(raw))
    cpu = default_config() | {"algorithm": "grpo", "devices": {}}
    cpu["actor"] = cpu["actor"] | {"workers": 4, "nodes": 2}  # a CPU group over two pods, any nodes
    assert placement_values(parse_config(cpu)) == {"actor": {"gpus": 0, "nodes": 2}, "reward": {"gpus": 0},
                                                   "persistence": {"accessModes": ["ReadWriteMany"]}}


def test_values_for_refuses_a_node_no_label_can_match():
    raw = default_config()
    raw["devices"] = {"actor": ["_node:0"], "reward": ["node1:0"], "critic": ["node1:1"]}
    with pytest.raises(ValueError, match=r"devices\.actor: node '_node'"):
        values_for(parse_config(raw))


def test_render_values_is_the_values_as_yaml():
    cfg = parse_config(two_node_config())
    text = render_values(cfg)
    assert text.startswith("#")
    assert yaml.safe_load(text) == chart_values(cfg)
    assert {k: {f: v for f, v in role.items() if f != "inputArgs"} for k, role in chart_values(cfg).items()
            if k != "model"} == values_for(cfg)


# --- docs ---------------------------------------------------------------------------------------

# Values documented as a whole, in one row each, rather than field by field.
DOCUMENTED_WHOLE = {"podSecurityContext", "securityContext", "probes.startup", "probes.readiness", "probes.liveness"}


def leaf_keys(values: dict, prefix: str = "") -> list[str]:
    """Dotted keys of values.yaml down to scalars, lists and empty maps: the rows of the docs tables."""
    keys = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted not in DOCUMENTED_WHOLE:
            keys += leaf_keys(value, f"{dotted}.")
        else:
            keys.append(dotted)
    return keys


def test_every_value_is_documented():
    """Each key is in a table row of the docs, as itself or, for a key every role has, as
    `<role>.KEY` (the per-role table)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    documented = {key for row in rows for key in re.findall(r"`([^`]+)`", row.split("|")[1])}
    missing = []
    for key in leaf_keys(yaml.safe_load((CHART / "values.yaml").read_text())):
        role, _, rest = key.partition(".")
        if key not in documented and not (role in (*GRPC_PORTS, "teacher") and f"<role>.{rest}" in documented):
            missing.append(key)
    assert not missing, f"values missing from the tables in {DOC.name}: {missing}"

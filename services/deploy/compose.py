"""`rolefleet deploy compose CONFIG`: the docker-compose.yml of one GPU node, generated from a run config.

One image runs every role (`rolefleet serve ROLE`); the config's devices map becomes each service's
GPU reservation, so the placement is written once, in the config. Every service gets the same
config file (mounted read-only), the user's own `key=value` overrides, then the overrides that only
hold inside a container: bind 0.0.0.0, the fixed ports of the convention below, the run output, the
container path of every model and file the role reads (`rolefleet.deploy.inputs`), and (for the
coordinator) the compose service names it dials. Models live in ./models (mounted at /models);
a file beside the config is under /configs; any other file's directory is mounted read-only at
/inputs/<n>. Roles the algorithm does not use are left out. `render_compose` is a pure function of
its arguments: the same config gives the same bytes, so a committed file can be compared with a
fresh render.

Security: each directory holding a file that security.tls.* or security.token_file names is mounted
read-only into every role at /etc/rolefleet/secrets/<n>, the keys are rewritten to those container
paths, the healthchecks speak TLS with the role's own certificate, and without a token_file the
token comes from the environment compose runs in (`ROLEFLEET_TOKEN=... docker compose up`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml

from rolefleet import __version__
from rolefleet.app.placement import require_map
from rolefleet.app.preflight import GPU_ROLES
from rolefleet.common.config import RoleFleetConfig, split_device
from rolefleet.deploy.inputs import (
    HOST_MODELS_DIR,
    INPUTS_DIR,
    MODELS_DIR,
    Input,
    mounted_path,
    path_overrides,
    role_inputs,
)
from rolefleet.trainer.nodes import layout_for

# Images, and the host ports published on loopback: each a variable of the environment compose runs
# in, with its default (a CPU image, a local Prometheus build, a port that is taken on this host).
IMAGE = f"${{ROLEFLEET_IMAGE:-rolefleet:{__version__}}}"
DOCKERFILE = "deploy/Dockerfile"
PROMETHEUS_IMAGE = "${PROMETHEUS_IMAGE:-prom/prometheus:v3.5.0}"
GRAFANA_IMAGE = "${GRAFANA_IMAGE:-grafana/grafana:11.6.1}"
HOST_PORT_VARIABLES = {"http": "ROLEFLEET_HTTP_PORT", "grpc": "ROLEFLEET_GRPC_PORT", "endpoint": "ROLEFLEET_ENDPOINT_PORT",
                       "prometheus": "PROMETHEUS_PORT", "grafana": "GRAFANA_PORT"}
# The port convention of every deployment (compose, Helm): one gRPC and one /metrics port per role.
GRPC_PORTS = {"coordinator": 50050, "actor": 50051, "reward": 50052, "critic": 50053, "teacher": 50054}
METRICS_PORTS = {"coordinator": 9100, "actor": 9101, "reward": 9102, "critic": 9103, "teacher": 9104}
HTTP_PORT = 8080
ENDPOINT_PORT = 8300  # the actor's OpenAI-compatible endpoint (actor.endpoint), where agents drive episodes
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000
# Container paths: run output and checkpoints on a named volume, models and configs bind-mounted.
# (MODELS_DIR, HOST_MODELS_DIR: ./models at /models, as in the Helm chart; deploy/inputs.py.)
# The directory of a file the config names (outside ./configs and ./models) is mounted read-only at
# INPUTS_DIR/<n>, one per directory, numbered in the order the roles' inputs name them.
RUNS_DIR, CONFIGS_DIR = "/runs", "/configs"
# Snapshots (checkpoint.snapshot) on a memory-backed volume that every role container mounts: it
# outlives a role container's restart (the others keep it mounted), not the whole project. A
# container's own /dev/shm (the default path) is 64 MiB and gone with its restart.
SNAPSHOTS_DIR = "/snapshots"
SNAPSHOTS_VOLUME = {"driver": "local", "driver_opts": {"type": "tmpfs", "device": "tmpfs"}}
# Where the directories of the TLS files and the token file are mounted (read-only), one per
# directory, numbered in the order of these keys.
SECRETS_DIR = "/etc/rolefleet/secrets"
SECRET_KEYS = ("security.tls.cert_file", "security.tls.key_file", "security.tls.ca_file", "security.token_file")
# What `docker compose` says, and refuses to start, when the run's token is not set where it runs.
# No "$" or "}" in it (compose would read them as part of the expression), nor ": " or "'" (YAML would
# quote the whole value).
TOKEN_MISSING = ("every role needs the token of the run, so put {name}=<a random secret of 16+ characters> in .env "
                 "beside docker-compose.yml (docs/deploy-compose.md)")
# A variable compose can interpolate (${NAME:-}).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# SERVING comes after the model load (and vLLM's warm-up), which a large checkpoint stretches to
# many minutes; failed probes inside the start period do not count against the retries.
ROLE_START_PERIOD = "20m"
COORDINATOR_START_PERIOD = "2m"
# SIGTERM stops a run after the step in flight (minutes on a large batch); compose stops the
# coordinator before the roles it depends on, so they serve that step to its end. Roles need less:
# in-flight calls get 10 s, then they free their GPUs.
COORDINATOR_STOP_GRACE, ROLE_STOP_GRACE = "10m", "1m"
# NCCL and vLLM move tensors between a role's worker processes through /dev/shm (Docker gives 64 MB).
SHM_SIZE = "16gb"
ROLE_SUMMARY = {
    "actor": "the policy: rollout engine, trainer and reference model",
    "reward": "scores samples",
    "critic": "the value model and its trainer",
    "teacher": "a frozen model grading the student's samples (on-policy distillation)",
    "coordinator": "runs the loop: dataset, advantages, journal, control plane",
}


def render_compose(cfg: RoleFleetConfig, config_path: str, overrides: Sequence[str] = ()) -> str:
    """The whole docker-compose.yml for `cfg`, which is the file `config_path` (relative to the
    directory the compose file lives in) with `overrides` (key=value) applied; every service gets them
    too. Raises ValueError for `devices: auto`, for a devices map that spans several nodes, for an
    override of a key compose sets itself, and for a model path that the mounts below cannot reach."""
    require_map(cfg, "a compose file")
    roles = cfg.roles()
    gpus = {role: gpu_ids(cfg, role) for role in roles}
    config_path = str(PurePosixPath(config_path))  # ./configs/x.yaml and configs/x.yaml render alike
    config_dir, config_name = _config_mount(config_path)
    _check_overrides(overrides)
    secrets = secret_mounts(cfg)
    inputs = InputMounts(config_dir)
    shared = [*overrides, f"run.output_dir={RUNS_DIR}/{cfg.run.name}", *secrets.overrides]
    snapshots = cfg.checkpoint.snapshot.enabled
    if snapshots:
        shared.append(f"checkpoint.snapshot.dir={SNAPSHOTS_DIR}/{cfg.run.name}")
    parts = [_header(config_path, overrides, gpus, cfg.coordinator.http_enabled, cfg, secrets),
             "name: rolefleet\n", "services:\n"]
    for role in roles:
        service = _role_service(cfg, role, gpus[role], config_name, shared, secrets, inputs, snapshots=snapshots)
        parts.append(_service_yaml(role, service, _role_comment(role, gpus[role])))
        for node in range(1, layout_for(role, cfg).nodes):  # a worker group over containers (CPU workers)
            service = _role_service(cfg, role, gpus[role], config_name, shared, secrets, inputs, node, snapshots)
            parts.append(_service_yaml(f"{role}-node{node}", service, [
                f"{role} node {node} of its worker group: torch's elastic agent of this container's ranks, which",
                f"meet the others at the rendezvous of the {role} service; restarted when it dies (the group forms",
                "anew and the run recovers from its checkpoint)."]))
    parts.append(_service_yaml("prometheus", _prometheus(), [
        "prometheus: scrapes every role's /metrics port (deploy/prometheus/prometheus.yml, alerts.yml)"]))
    parts.append(_service_yaml("grafana", _grafana(), [
        "grafana: the dashboards of deploy/grafana, over Prometheus"]))
    volumes = {"runs": {}, "prometheus": {}, **({"snapshots": SNAPSHOTS_VOLUME} if snapshots else {})}
    parts.append(yaml.safe_dump({"volumes": volumes}, sort_keys=False))
    return "".join(parts)


def gpu_ids(cfg: RoleFleetConfig, role: str) -> list[str]:
    """The GPUs `role` reserves (compose device_ids are strings); none for the coordinator."""
    if role not in GPU_ROLES:
        return []
    groups = [role, "rollout"] if role == "actor" else [role]
    for group in groups:
        remote = [str(d) for d in getattr(cfg.devices, group) if split_device(d)[0] is not None]
        if remote:
            raise ValueError(f"devices.{group}: {', '.join(remote)}: docker compose runs on one node; "
                             "node-qualified entries are for the Helm chart (list GPU indices of this node)")
    return [str(split_device(d)[1]) for d in getattr(cfg.devices, role)]


# --- the role services ---------------------------------------------------------------------------

def _role_service(cfg: RoleFleetConfig, role: str, gpus: list[str], config_name: str, shared: list[str],
                  secrets: SecretMounts, inputs: InputMounts, node: int = 0, snapshots: bool = False) -> dict[str, Any]:
    """The service of `role`, or of node `node` >= 1 of its worker group (no gRPC: node 0 serves);
    `snapshots`: with the snapshot volume."""
    reads = inputs.place(cfg, role)
    command = [role, "--config", f"{CONFIGS_DIR}/{config_name}", *(["--node-rank", str(node)] if node else []),
               *shared, *reads.overrides, *_endpoint_overrides(cfg, role)]
    if layout_for(role, cfg).spans:  # the group's nodes meet at node 0's container, by its service name
        command.append(f"{role}.rendezvous.host={role}")
    volumes = ["runs:" + RUNS_DIR, *(["snapshots:" + SNAPSHOTS_DIR] if snapshots else []), *reads.volumes,
               *secrets.volumes]
    service: dict[str, Any] = {"image": IMAGE, "build": {"context": ".", "dockerfile": DOCKERFILE},
                               "command": [_literal(word) for word in command]}
    if gpus:
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": _Flow(gpus), "capabilities": _Flow(["gpu"])}]}}}
        service["shm_size"] = SHM_SIZE
    else:
        service["environment"] = {"NVIDIA_VISIBLE_DEVICES": "void"}
    if secrets.environment:
        service["environment"] = {**service.get("environment", {}), **secrets.environment}
    service.update({
        "init": True,  # reaps the worker processes a role starts, and forwards SIGTERM to the role
        "restart": "no" if role == "coordinator" else "unless-stopped",
        "stop_grace_period": COORDINATOR_STOP_GRACE if role == "coordinator" else ROLE_STOP_GRACE,
        "volumes": volumes,
    })
    if role == "actor" and cfg.reward.agent.external:  # agents outside the project claim episodes there
        service["ports"] = [_published("endpoint", ENDPOINT_PORT)]
    if role == "coordinator":
        service["ports"] = ([_published("http", HTTP_PORT)] if cfg.coordinator.http_enabled else []) + [
            _published("grpc", GRPC_PORTS["coordinator"])]
        service["depends_on"] = {r: {"condition": "service_healthy"} for r in cfg.roles() if r != "coordinator"}
    if not node:
        service["healthcheck"] = _healthcheck(role, _healthcheck_tls(cfg, role, secrets))
    return service


def _healthcheck(role: str, tls: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "test": _Flow(["CMD", "python", "-m", "rolefleet.deploy.healthcheck", f"127.0.0.1:{GRPC_PORTS[role]}",
                       "--timeout", "5", *tls]),
        "interval": "10s",
        "timeout": "10s",
        "retries": 3,
        "start_period": COORDINATOR_START_PERIOD if role == "coordinator" else ROLE_START_PERIOD,
    }


def _healthcheck_tls(cfg: RoleFleetConfig, role: str, secrets: SecretMounts) -> list[str]:
    """The probe's TLS flags: the CA, and the role's own certificate as the client certificate that
    a mutual-TLS server asks for (every certificate of `rolefleet certs` is both)."""
    tls = cfg.security.tls
    if not tls.enabled:
        return []
    flags = []
    for flag, key in (("--ca", "ca_file"), ("--cert", "cert_file"), ("--key", "key_file")):
        if getattr(tls, key):
            flags += [flag, secrets.paths[f"security.tls.{key}"].replace("{role}", role)]
    if tls.server_name:
        flags += ["--server-name", tls.server_name]
    return flags


def _endpoint_overrides(cfg: RoleFleetConfig, role: str) -> list[str]:
    own = [f"{role}.host=0.0.0.0", f"{role}.port={GRPC_PORTS[role]}", f"{role}.metrics_port={METRICS_PORTS[role]}"]
    if role == "actor" and cfg.actor.endpoint.enabled:  # the reward role's agents dial it over the project's network
        own += ["actor.endpoint.host=0.0.0.0", f"actor.endpoint.port={ENDPOINT_PORT}"]
    if role != "coordinator":
        return own
    # The control plane listens on every interface of the container; the host publishes it on
    # loopback only (see the ports of the coordinator service).
    http = ["coordinator.http_host=0.0.0.0", f"coordinator.http_port={HTTP_PORT}"]
    if not cfg.coordinator.http_enabled:
        http = []
    dials = [f"{r}.address={r}:{GRPC_PORTS[r]}" for r in cfg.roles() if r != "coordinator"]
    if cfg.actor.endpoint.enabled:
        scheme = "https" if cfg.security.tls.enabled else "http"
        dials.append(f"actor.endpoint.url={scheme}://actor:{ENDPOINT_PORT}")
    return own + http + dials


def _published(name: str, port: int) -> str:
    """A container port published on the host's loopback, at ${VARIABLE:-port} of the host."""
    return f"127.0.0.1:${{{HOST_PORT_VARIABLES[name]}:-{port}}}:{port}"


def _literal(word: str) -> str:
    """`word` as compose passes it on: compose reads $ as the start of a variable ($$ is a $)."""
    return word.replace("$", "$$")


def _owned_keys() -> set[str]:
    """Keys compose sets on every command line itself (what holds inside a container)."""
    keys = {"run.output_dir", "checkpoint.snapshot.dir", "coordinator.http_host", "coordinator.http_port",
            "actor.endpoint.host", "actor.endpoint.port", "actor.endpoint.url"}
    for role in GRPC_PORTS:
        keys |= {f"{role}.host", f"{role}.port", f"{role}.metrics_port", f"{role}.address", f"{role}.rendezvous.host"}
    return keys


def _check_overrides(overrides: Sequence[str]) -> None:
    owned = _owned_keys()
    for override in overrides:
        key = override.partition("=")[0]
        if key in owned:
            raise ValueError(f"override {override!r}: compose sets {key} itself (the container's ports, addresses "
                             "and output directory: docs/deploy-compose.md); leave it out")


@dataclass
class Placed:
    """One role's view of what it reads: the mounts it needs and the keys pointed at them."""

    volumes: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)


class InputMounts:
    """Where every model and file of a run is seen inside the containers (`rolefleet.deploy.inputs`):
    models under ./models at /models, files beside the config under /configs, any other file's
    directory at /inputs/<n>, numbered once for the whole file so that every role sees a file at
    the same path."""

    def __init__(self, config_dir: str):
        self.config_dir = config_dir
        self.dirs: dict[str, str] = {}  # host directory -> /inputs/<n>

    def place(self, cfg: RoleFleetConfig, role: str) -> Placed:
        placed = Placed(volumes=[f"{self.config_dir}:{CONFIGS_DIR}:ro"])
        inside: dict[str, str] = {}
        for item in role_inputs(cfg, role):
            inside[item.key] = self.container_path(item)
            mount = self._mount_of(inside[item.key])
            if mount not in placed.volumes:
                placed.volumes.append(mount)
        placed.volumes.sort(key=lambda v: (v.split(":")[1] != MODELS_DIR, v.split(":")[1] != CONFIGS_DIR))
        placed.overrides = path_overrides(cfg, inside)
        return placed

    def container_path(self, item: Input) -> str:
        if item.kind == "model":
            return container_model_path(item.key, item.path)
        for host, target in ((self.config_dir, CONFIGS_DIR), (HOST_MODELS_DIR, MODELS_DIR)):
            if (inside := mounted_path(item.path, host, target)) is not None:
                return inside
        path = PurePosixPath(item.path)
        if not path.name or path.name in (".", ".."):
            raise ValueError(f"{item.key}: {item.path!r} names no file")
        # The file's directory, or the one it needs whole (its package's parent), mounted.
        host_dir = _host_dir(PurePosixPath(item.root, "-") if item.root else path)
        self.dirs.setdefault(host_dir, f"{INPUTS_DIR}/{len(self.dirs)}")
        return f"{self.dirs[host_dir]}/{path.relative_to(item.root) if item.root else path.name}"

    def _mount_of(self, container_path: str) -> str:
        if container_path.startswith(MODELS_DIR + "/"):
            return f"./{HOST_MODELS_DIR}:{MODELS_DIR}:ro"
        if container_path.startswith(CONFIGS_DIR + "/"):
            return f"{self.config_dir}:{CONFIGS_DIR}:ro"
        host, target = next((h, t) for h, t in self.dirs.items() if container_path.startswith(t + "/"))
        return f"{host}:{target}:ro"


def container_model_path(key: str, path: str) -> str:
    """Where the model `key` names is seen in a container: ./models is mounted at /models. The image
    reads no hub (HF_HUB_OFFLINE=1), so anything outside ./models is refused here, not at start."""
    inside = mounted_path(path, HOST_MODELS_DIR, MODELS_DIR)
    if inside is not None:
        return inside
    raise ValueError(f"{key}: {path!r} is outside ./{HOST_MODELS_DIR}, the directory compose mounts at "
                     f"{MODELS_DIR} (read-only; the image does not download from a hub): put the model "
                     f"in ./{HOST_MODELS_DIR}/<name> and set {key}={HOST_MODELS_DIR}/<name>")


@dataclass
class SecretMounts:
    """What the config's security files need in every role container."""

    volumes: list[str] = field(default_factory=list)      # "HOST_DIR:/etc/rolefleet/secrets/<n>:ro"
    overrides: list[str] = field(default_factory=list)    # security.*=<container path>
    paths: dict[str, str] = field(default_factory=dict)   # key -> container path ("{role}" kept)
    environment: dict[str, str] = field(default_factory=dict)  # the token, passed from compose's environment


def secret_mounts(cfg: RoleFleetConfig) -> SecretMounts:
    """Mount each distinct directory of the files security.tls.* and security.token_file name, read-only,
    at /etc/rolefleet/secrets/<n> (numbered in the order of SECRET_KEYS), and point the keys there.
    Relative paths are relative to where `docker compose` runs, like ./configs and ./models. A
    "{role}" may stand in a file name (every role then finds its own file in the one directory),
    not in a directory name. Without a token_file, the variable security.token_env names is passed
    through from the environment compose runs in, whether or not the config has a `security` section:
    a token set where `docker compose up` runs must never be silently dropped."""
    mounts = SecretMounts()
    security, dirs = cfg.security, {}
    values = {"security.tls.cert_file": security.tls.cert_file, "security.tls.key_file": security.tls.key_file,
              "security.tls.ca_file": security.tls.ca_file, "security.token_file": security.token_file}
    for key in SECRET_KEYS:
        if not values[key]:
            continue
        path = PurePosixPath(values[key])
        host_dir, name = _host_dir(path), path.name
        if not name or name in (".", ".."):
            raise ValueError(f"{key}: {values[key]!r} names no file")
        if "{role}" in str(path.parent):
            raise ValueError(f"{key}: {values[key]!r}: compose mounts one directory into every role, so "
                             "\"{role}\" may stand in the file name only (as in rolefleet certs' DIR/{role}.pem)")
        if host_dir not in dirs:
            dirs[host_dir] = f"{SECRETS_DIR}/{len(dirs)}"
            mounts.volumes.append(f"{host_dir}:{dirs[host_dir]}:ro")
        mounts.paths[key] = f"{dirs[host_dir]}/{name}"
        mounts.overrides.append(f"{key}={mounts.paths[key]}")
    if not security.token_file and security.token_env:
        if not _ENV_NAME.fullmatch(security.token_env):
            raise ValueError(f"security.token_env: {security.token_env!r} is not a variable name compose can "
                             "pass through (letters, digits and _, not starting with a digit)")
        name = security.token_env
        # Required unless something else authenticates callers: every role binds all interfaces of
        # its container, where it refuses to start open (docs/security.md); compose says so first.
        optional = security.allow_unauthenticated or (security.tls.enabled and security.tls.mutual)
        mounts.environment[name] = f"${{{name}:-}}" if optional else f"${{{name}:?{TOKEN_MISSING.format(name=name)}}}"
    return mounts


def _host_dir(path: PurePosixPath) -> str:
    """The directory holding `path`, as a compose bind-mount source (./ before a relative one)."""
    parent = str(path.parent)
    return parent if path.is_absolute() or parent.startswith(".") else f"./{parent}"


def _config_mount(config_path: str) -> tuple[str, str]:
    """(the host directory mounted at /configs, the config's file name)."""
    path = PurePosixPath(config_path)
    if not path.name:
        raise ValueError(f"config path {config_path!r} names no file")
    parent = str(path.parent)
    return (parent if path.is_absolute() or parent.startswith(".") else f"./{parent}"), path.name


# --- monitoring ----------------------------------------------------------------------------------

def _prometheus() -> dict[str, Any]:
    return {
        "image": PROMETHEUS_IMAGE,
        "command": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"],
        "restart": "unless-stopped",
        "volumes": ["./deploy/prometheus:/etc/prometheus:ro", "prometheus:/prometheus"],
        "ports": [_published("prometheus", PROMETHEUS_PORT)],
    }


def _grafana() -> dict[str, Any]:
    return {
        "image": GRAFANA_IMAGE,
        "restart": "unless-stopped",
        "volumes": ["./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
                    "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro"],
        "ports": [_published("grafana", GRAFANA_PORT)],
        "depends_on": ["prometheus"],
    }


# --- text ----------------------------------------------------------------------------------------

def _header(config_path: str, overrides: Sequence[str], gpus: dict[str, list[str]], http: bool,
            cfg: RoleFleetConfig, secrets: SecretMounts) -> str:
    placement = "; ".join(f"{role} {'GPUs ' + ','.join(ids) if ids else 'no GPU'}" for role, ids in gpus.items())
    scheme = "https" if cfg.security.tls.enabled else "http"
    port = {name: f"127.0.0.1:{default} (${HOST_PORT_VARIABLES[name]})" for name, default in
            (("http", HTTP_PORT), ("grpc", GRPC_PORTS["coordinator"]), ("prometheus", PROMETHEUS_PORT),
             ("grafana", GRAFANA_PORT))}
    published = [*([f"control plane {scheme}://{port['http']}"] if http else []),
                 f"coordinator gRPC {port['grpc']}, for rolefleet status",
                 f"Prometheus http://{port['prometheus']}", f"Grafana http://{port['grafana']}"]
    guarded = _security_summary(cfg, secrets)
    command = " ".join(["rolefleet deploy compose", config_path, *overrides])
    lines = [
        f"Generated from {config_path} by `{command} > docker-compose.yml`.",
        "Do not edit by hand: change the config (its devices map places the roles) and generate it again.",
        f"Placement: {placement}.",
        "Published on this host's loopback only, each port a variable where compose runs" + (
            ":" if guarded else " (the control plane and the gRPC API ask for no credentials):"),
        *[f"  {p}" for p in published],
        *guarded,
        "Walk-through: docs/deploy-compose.md.",
    ]
    return "".join(f"# {line}\n" for line in lines)


def _security_summary(cfg: RoleFleetConfig, secrets: SecretMounts) -> list[str]:
    """Header lines on what the roles demand of callers."""
    security, lines = cfg.security, []
    if security.tls.enabled:
        lines.append(f"Security: {'mutual ' if security.tls.mutual else ''}TLS on every role's gRPC port and on the "
                     "control plane.")
    if security.token_file:
        lines.append(f"The run's token: {security.token_file} (security.token_file).")
    elif secrets.environment:
        [name] = secrets.environment
        required = not secrets.environment[name].endswith(":-}")
        lines.append(f"The run's token: ${name} where `docker compose up` runs (security.token_env)"
                     + ("; compose refuses to start without it." if required else ", if set."))
    if secrets.volumes:
        lines.append(f"Mounted read-only into every role at {SECRETS_DIR}/<n>: "
                     f"{', '.join(v.split(':')[0] for v in secrets.volumes)}.")
    return lines or ["Security: no TLS and no token (docs/security.md)."]


def _role_comment(role: str, gpus: list[str]) -> list[str]:
    lines = [f"{role}: {ROLE_SUMMARY[role]}."]
    if gpus:
        lines.append(f"GPUs {','.join(gpus)} (devices.{role}): the only GPUs the container sees.")
    else:
        lines.append("No GPU: NVIDIA_VISIBLE_DEVICES=void hides them even where nvidia is the default runtime.")
    if role == "coordinator":
        lines += ["Starts once every role answers SERVING. Never restarted: a new start would run again over",
                  "the outputs of a finished or failed run (its logs stay: docker compose logs coordinator).",
                  f"SIGTERM stops the run after the step in flight (stop grace {COORDINATOR_STOP_GRACE})."]
    else:
        lines.append("Restarted when it dies; the coordinator carries the run on.")
    return lines


class _Flow(list):
    """A list written on one line (`[a, b]`): GPU ids and probe commands read best that way."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda dumper, data: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=True))


def _service_yaml(name: str, service: dict[str, Any], comment: list[str]) -> str:
    body = yaml.dump({name: service}, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
    return "".join(f"  # {line}\n" for line in comment) + "".join(f"  {line}\n" for line in body.splitlines())

"""docker-compose.yml, the container image and its healthcheck probe.

The compose file is generated from configs/8gpu.yaml and must stay a fresh render of it; it must pass
`docker compose config`; its GPU reservations must be the config's devices map; each service's
command must load as a valid config inside its container, security files included. The probe is run
against a real role server, and over mutual TLS against a TLS server. The Dockerfile cannot be built
here (a Docker client, no engine), so it is only read: its base is pinned, it installs the project
with vLLM, it runs `rolefleet serve` as a non-root user.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import re
import socket
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml
from grpc_health.v1 import health_pb2

from rolefleet.app.preflight import MODEL_KEYS
from rolefleet.certs import make_certs
from rolefleet.common.config import Endpoint, RewardSection, load_config
from rolefleet.deploy.compose import SECRETS_DIR, TOKEN_MISSING, render_compose
from rolefleet.deploy.inputs import CODE_KEYS, Input, role_inputs
from rolefleet.reward import server as reward_server
from rolefleet.reward.core import RewardCore
from rolefleet.rpc.server import start_server
from tests.deploy.tools import REPO, healthcheck, mutual_tls_health_server, tool
from tests.e2e.procs import rolefleet, terminate, wait_ready

pytestmark = pytest.mark.procs

CONFIG = "configs/8gpu.yaml"
COMPOSE = REPO / "docker-compose.yml"
REGENERATE = f"rolefleet deploy compose {CONFIG} > docker-compose.yml"
# The port convention every deployment shares (compose, the Helm chart, prometheus.yml).
GRPC_PORTS = {"coordinator": 50050, "actor": 50051, "reward": 50052, "critic": 50053}
METRICS_PORTS = {"coordinator": 9100, "actor": 9101, "reward": 9102, "critic": 9103}
MONITORING = {"prometheus", "grafana"}
REQUIRED_TOKEN = "${ROLEFLEET_TOKEN:?" + TOKEN_MISSING.format(name="ROLEFLEET_TOKEN") + "}"
A_TOKEN = {"ROLEFLEET_TOKEN": "compose-test-token-0123456789"}


def render(*overrides: str) -> str:
    """`rolefleet deploy compose configs/8gpu.yaml OVERRIDES`."""
    return render_compose(load_config(REPO / CONFIG, list(overrides)), CONFIG, overrides)


def committed() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def reservations(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def compose_config(path: Path, environ: dict[str, str] = A_TOKEN) -> subprocess.CompletedProcess:
    """`docker compose config -q` where `environ` is set (and ROLEFLEET_TOKEN only if it says so)."""
    env = {k: v for k, v in os.environ.items() if k != "ROLEFLEET_TOKEN"} | environ
    return subprocess.run([tool("docker-compose"), "-f", str(path), "--project-directory", str(REPO), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


# --- the generated file --------------------------------------------------------------------------

def test_the_committed_compose_file_is_a_fresh_render_of_the_8gpu_config():
    fresh, current = render(), COMPOSE.read_text()
    diff = "".join(difflib.unified_diff(current.splitlines(True), fresh.splitlines(True),
                                        "docker-compose.yml (committed)", "fresh render", n=1))
    assert current == fresh, f"docker-compose.yml is stale: regenerate it with `{REGENERATE}`\n{diff[:3000]}"
    assert fresh == render(), "two renders of one config differ"
    assert fresh.startswith(f"# Generated from {CONFIG} by `{REGENERATE}`.\n# Do not edit by hand")


@pytest.mark.parametrize("overrides", [(), ("algorithm=grpo",)], ids=["committed", "grpo"])
def test_docker_compose_config_accepts_the_file(tmp_path, overrides):
    path = COMPOSE
    if overrides:
        path = tmp_path / "docker-compose.yml"
        path.write_text(render(*overrides))
    result = compose_config(path)
    assert result.returncode == 0, result.stderr
    # The same check refuses what compose would refuse: it is not a no-op.
    broken = tmp_path / "broken.yml"
    broken.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: healthy", 1))
    result = compose_config(broken)
    assert result.returncode != 0 and "condition" in result.stderr


def test_gpu_reservations_are_the_devices_map_and_the_coordinator_has_none():
    cfg, services = load_config(REPO / CONFIG), committed()["services"]
    assert set(services) == {*cfg.roles(), *MONITORING}
    gpu_roles = [role for role in ("actor", "reward", "critic") if getattr(cfg.devices, role)]
    assert gpu_roles == ["actor", "critic"]  # the shipped map's reward runs a CPU rule: no GPU for it
    for role in gpu_roles:
        [reservation] = reservations(services[role])
        assert reservation == {"driver": "nvidia", "device_ids": [str(i) for i in getattr(cfg.devices, role)],
                               "capabilities": ["gpu"]}, role
        assert "CUDA_VISIBLE_DEVICES" not in json.dumps(services[role])  # the reservation alone picks the GPUs
    for name in ("reward", "coordinator", *MONITORING):
        assert reservations(services[name]) == [] and "gpus" not in services[name], name
    for name in ("reward", "coordinator"):
        assert services[name]["environment"] == {"NVIDIA_VISIBLE_DEVICES": "void", "ROLEFLEET_TOKEN": REQUIRED_TOKEN}


def test_a_grpo_render_leaves_the_critic_out_and_follows_another_placement():
    services = yaml.safe_load(render("algorithm=grpo", "devices.actor=[2,3,4,5]", "devices.rollout=[2,3]",
                                     "devices.reward=[7]", "devices.critic=[]"))["services"]
    assert set(services) == {"actor", "reward", "coordinator", *MONITORING}
    assert reservations(services["actor"])[0]["device_ids"] == ["2", "3", "4", "5"]
    assert reservations(services["reward"])[0]["device_ids"] == ["7"]
    coordinator = services["coordinator"]
    assert set(coordinator["depends_on"]) == {"actor", "reward"}
    assert not [a for a in coordinator["command"] if a.startswith("critic.")]


def test_a_node_qualified_device_is_refused_naming_its_group():
    with pytest.raises(ValueError, match=r"devices\.reward: node1:4, node1:5: docker compose runs on one node"):
        render("devices.reward=['node1:4', 'node1:5']")
    with pytest.raises(ValueError, match=r"devices\.actor: node0:0, node0:1"):
        render("devices.actor=['node0:0', 'node0:1']", "devices.rollout=['node0:1']")


@pytest.mark.multinode
def test_a_worker_group_over_several_nodes_gets_a_container_per_node():
    """CPU workers over `actor.nodes` containers: node 0 is the actor service (the server, the
    rendezvous), every other node a service of its own that meets it there by its service name."""
    services = yaml.safe_load(render("devices.rollout=[]", "devices.actor=[]", "actor.workers=4",
                                     "actor.nodes=2"))["services"]
    assert {"actor", "actor-node1"} <= set(services) and "actor-node2" not in services
    actor, node = command_values(services["actor"]), command_values(services["actor-node1"])
    assert actor["actor.rendezvous.host"] == node["actor.rendezvous.host"] == "actor"
    assert "--node-rank" not in services["actor"]["command"]
    assert services["actor-node1"]["command"][3:5] == ["--node-rank", "1"]
    assert "healthcheck" not in services["actor-node1"]  # no gRPC there: node 0 serves
    assert services["actor-node1"]["restart"] == "unless-stopped"
    assert set(services["coordinator"]["depends_on"]) == {"actor", "reward", "critic"}
    with pytest.raises(ValueError, match=r"override 'actor\.rendezvous\.host=x': compose sets"):
        render("devices.rollout=[]", "devices.actor=[]", "actor.workers=4", "actor.nodes=2", "actor.rendezvous.host=x")


def test_a_model_outside_the_mounted_models_directory_is_refused():
    with pytest.raises(ValueError, match=r"actor\.model_name_or_path: 'Qwen/Qwen2-1\.5B' is outside \./models"):
        render("model.model_name_or_path=Qwen/Qwen2-1.5B")
    with pytest.raises(ValueError, match=r"critic\.model_name_or_path: 'runs/value' is outside \./models"):
        render("critic.model_name_or_path=runs/value")


# --- each service, as its container sees it -----------------------------------------------------

def host_path(service: dict, container_path: str) -> Path | None:
    """The host path behind `container_path` through the service's bind mounts, or None."""
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            try:
                rest = PurePosixPath(container_path).relative_to(target)
            except ValueError:
                continue
            return (REPO / source / rest).resolve()
    return None


def container_config(service: dict):
    role, flag, path, *overrides = service["command"]
    assert flag == "--config"
    return role, load_config(host_path(service, path), overrides)


def test_every_service_command_loads_as_a_config_that_binds_its_fixed_ports():
    host_cfg, services = load_config(REPO / CONFIG), committed()["services"]
    for role in host_cfg.roles():
        service = services[role]
        name, cfg = container_config(service)
        section = getattr(cfg, name)
        assert (name, section.host, section.port, section.metrics_port) == (
            role, "0.0.0.0", GRPC_PORTS[role], METRICS_PORTS[role])
        assert service["healthcheck"]["test"][:5] == ["CMD", "python", "-m", "rolefleet.deploy.healthcheck",
                                                      f"127.0.0.1:{GRPC_PORTS[role]}"]
        assert str(cfg.run.out) == "/runs/8gpu" and "runs:/runs" in service["volumes"]
        for key in MODEL_KEYS.get(role, ()):  # the container path is the host's models/policy, read-only
            section_name, field = key.split(".")
            model = getattr(getattr(cfg, section_name), field)
            assert host_path(service, model) == (REPO / host_cfg.model.model_name_or_path).resolve(), key
            assert "./models:/models:ro" in service["volumes"]
    _, coordinator = container_config(services["coordinator"])
    assert (coordinator.coordinator.http_host, coordinator.coordinator.http_port) == ("0.0.0.0", 8080)
    for role in ("actor", "reward", "critic"):  # the coordinator dials the compose service names
        assert getattr(coordinator, role).dial_address(role) == f"{role}:{GRPC_PORTS[role]}"


# --- every model and file a role reads, in its container ------------------------------------------

def command_values(service: dict) -> dict[str, str]:
    """The last value each key=value of the service's command sets (as the config loader applies them),
    as the container gets it (compose passes $$ on as $)."""
    return dict(word.replace("$$", "$").split("=", 1) for word in service["command"]
                if "=" in word and not word.startswith("-"))


def read_in_container(service: dict, item: Input) -> Path | None:
    """The host path behind what the container reads for `item`, through the service's mounts."""
    values = command_values(service)
    if item.key.startswith("reward.sources."):
        _, _, index, field = item.key.split(".")
        path = json.loads(values["reward.sources"])[int(index)][field].rpartition(":")
        path = path[0] if field == "path" and path[0] else path[2]
    elif item.key.startswith("data.tools."):
        path = json.loads(values["data.tools"])[int(item.key.rpartition(".")[2])].rpartition(":")[0]
    else:
        path = values[item.key].rpartition(":")[0] if item.key in CODE_KEYS else values[item.key]
    return host_path(service, path)


def deployable(name: str) -> list[str]:
    """Overrides that make a shipped config deployable by compose: its models under ./models."""
    cfg = load_config(REPO / "configs" / name)
    moves = [] if cfg.model.model_name_or_path.startswith("models/") else ["model.model_name_or_path=models/policy"]
    if cfg.uses_teacher and not cfg.teacher.model_name_or_path.startswith("models/"):
        moves.append("teacher.model_name_or_path=models/teacher")
    return moves


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_gives_each_role_what_it_reads(name):
    overrides = deployable(name)
    cfg = load_config(REPO / "configs" / name, overrides)
    services = yaml.safe_load(render_compose(cfg, f"configs/{name}", overrides))["services"]
    for role in cfg.roles():
        for item in role_inputs(cfg, role):
            assert read_in_container(services[role], item) == (REPO / item.path).resolve(), (role, item)


def test_an_openenv_environment_s_whole_package_is_mounted_for_its_relative_imports(tmp_path):
    """An environment file as `openenv init` writes it (server/env.py importing ..models): the
    reward role mounts the directory above its package and reads the file under it."""
    package = tmp_path / "envs" / "echo_task"
    (package / "server").mkdir(parents=True)
    for name in ("__init__.py", "models.py", "server/__init__.py", "server/env.py"):
        (package / name).write_text("")
    overrides = [f"reward.agent.openenv.environment={package}/server/env.py:EchoEnv"]
    cfg = load_config(REPO / "configs" / "demo_openenv.yaml", [*overrides, "model.model_name_or_path=models/policy"])
    services = yaml.safe_load(render_compose(cfg, "configs/demo_openenv.yaml", overrides))["services"]
    reward = services["reward"]
    assert f"{tmp_path}/envs:/inputs/0:ro" in reward["volumes"]
    assert command_values(reward)["reward.agent.openenv.environment"] == "/inputs/0/echo_task/server/env.py:EchoEnv"
    assert host_path(reward, "/inputs/0/echo_task/models.py") == package / "models.py"  # its package beside it
    assert not any("/inputs/" in v for v in services["actor"]["volumes"])


def test_models_data_eval_and_code_reach_only_the_roles_that_read_them(tmp_path):
    """A chat run whose files live in several directories: each is mounted, read-only, where it is read."""
    (tmp_path / "data").mkdir()
    for name in ("data/train.jsonl", "held_out.jsonl"):
        (tmp_path / name).write_text('{"prompt": [{"role": "user", "content": "1+1="}], "ground_truth": "2"}\n')
    overrides = [f"data.path={tmp_path}/data/train.jsonl", f"eval.path={tmp_path}/held_out.jsonl", "eval.every=5",
                 "critic.model_name_or_path=models/value",
                 "reward.sources=[{kind: user, path: rewards/exact.py:score}, {kind: model, path: models/rm},"
                 " {function: regex, pattern: '\\d+$'}]"]
    cfg = load_config(REPO / CONFIG, overrides)
    services = yaml.safe_load(render_compose(cfg, CONFIG, overrides))["services"]
    inputs = {f"{tmp_path}/data:/inputs/0:ro", f"{tmp_path}:/inputs/1:ro"}
    for role in cfg.roles():
        volumes = set(services[role]["volumes"])
        assert inputs <= volumes, role  # every role validates the whole config: the prompt files
        assert "./models:/models:ro" in volumes, role  # the reward for its model source, the coordinator a tokenizer
        for item in role_inputs(cfg, role):
            assert read_in_container(services[role], item) == (REPO / item.path).resolve(), (role, item)
    reward, critic = command_values(services["reward"]), command_values(services["critic"])
    assert "./rewards:/inputs/2:ro" in services["reward"]["volumes"]
    assert not [v for r in ("actor", "critic", "coordinator") for v in services[r]["volumes"] if "rewards" in v]
    assert json.loads(reward["reward.sources"]) == [
        {"name": "exact", "kind": "user", "path": "/inputs/2/exact.py:score", "weight": 1.0, "batched": False},
        {"name": "model", "kind": "model", "path": "/models/rm", "weight": 1.0, "batched": False},
        {"name": "regex", "kind": "function", "function": "regex", "weight": 1.0, "batched": False,
         "pattern": "\\d+$", "ignore_case": False}]
    assert "$$" in json.dumps(services["reward"]["command"])  # compose passes a literal $ on
    assert critic["critic.model_name_or_path"] == "/models/value"
    assert command_values(services["coordinator"])["actor.model_name_or_path"] == "/models/policy"


def test_user_tool_files_reach_every_role_and_data_tools_points_inside(tmp_path):
    """Every role validates the whole config, and that builds the user tools' schemas from their
    files; the reward role runs them. The override keeps built-ins and each tool's :function."""
    (tmp_path / "glossary.py").write_text("def lookup(word: str) -> str:\n    return word\n")
    overrides = [f"data.tools=[calculator, {tmp_path}/glossary.py:lookup]", "reward.env.name=tools",
                 "actor.rollout.max_turns=2"]
    cfg = load_config(REPO / CONFIG, overrides)
    services = yaml.safe_load(render_compose(cfg, CONFIG, overrides))["services"]
    for role in cfg.roles():
        items = [i for i in role_inputs(cfg, role) if i.key.startswith("data.tools")]
        assert items == [Input("data.tools.1", f"{tmp_path}/glossary.py", "file")], role
        assert f"{tmp_path}:/inputs/0:ro" in services[role]["volumes"], role
        assert json.loads(command_values(services[role])["data.tools"]) == ["calculator", "/inputs/0/glossary.py:lookup"]
        assert read_in_container(services[role], items[0]) == tmp_path / "glossary.py"


def test_an_override_of_a_key_compose_owns_is_refused_and_others_reach_every_service():
    with pytest.raises(ValueError, match=r"override 'coordinator\.http_port=9000': compose sets coordinator\.http_port"):
        render("coordinator.http_port=9000")
    services = yaml.safe_load(render("train.total_steps=7"))["services"]
    for role in ("actor", "reward", "critic", "coordinator"):
        assert command_values(services[role])["train.total_steps"] == "7", role
    assert "rolefleet deploy compose configs/8gpu.yaml train.total_steps=7 > docker-compose.yml" in render(
        "train.total_steps=7")


def test_the_coordinator_waits_for_healthy_roles_and_publishes_on_loopback_only():
    services = committed()["services"]
    assert services["coordinator"]["depends_on"] == {r: {"condition": "service_healthy"}
                                                     for r in ("actor", "reward", "critic")}
    # A dead role comes back and the run carries on; a run that ended is not started over its outputs.
    assert {n: services[n]["restart"] for n in GRPC_PORTS} == {
        "coordinator": "no", "actor": "unless-stopped", "reward": "unless-stopped", "critic": "unless-stopped"}
    published = {name: s.get("ports", []) for name, s in services.items()}
    # Each host port a variable of the environment compose runs in, with the convention's port by default.
    assert published == {"actor": [], "reward": [], "critic": [],
                         "coordinator": ["127.0.0.1:${ROLEFLEET_HTTP_PORT:-8080}:8080",
                                         "127.0.0.1:${ROLEFLEET_GRPC_PORT:-50050}:50050"],
                         "prometheus": ["127.0.0.1:${PROMETHEUS_PORT:-9090}:9090"],
                         "grafana": ["127.0.0.1:${GRAFANA_PORT:-3000}:3000"]}
    start = {name: services[name]["healthcheck"]["start_period"] for name in ("actor", "reward", "critic")}
    assert all(re.fullmatch(r"\d+m", p) and int(p[:-1]) >= 10 for p in start.values()), start  # a model load


def test_prometheus_scrapes_every_role_service_on_its_metrics_port():
    scrape = (REPO / "deploy" / "prometheus" / "prometheus.yml").read_text()
    targets = {t for job in yaml.safe_load(scrape)["scrape_configs"]
               for group in job.get("static_configs", []) for t in group["targets"]}
    services = committed()["services"]
    assert {f"{role}:{METRICS_PORTS[role]}" for role in GRPC_PORTS} <= targets
    assert services["prometheus"]["command"][0] == "--config.file=/etc/prometheus/prometheus.yml"
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert {"./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
            "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro"} <= set(services["grafana"]["volumes"])
    for name in MONITORING:  # pinned, never `latest` (a variable may name a local build instead)
        assert re.fullmatch(r"\$\{[A-Z_]+:-[a-z/]+:v?\d+\.\d+\.\d+\}", services[name]["image"]), services[name]["image"]


# --- security: certificates and the token ---------------------------------------------------------

ROLES = ("actor", "reward", "critic", "coordinator")


def secured(certs: Path, **more) -> dict:
    """The security section of a mutual-TLS run whose CA sits in another directory than the leaves
    (two mounts), with a token file in a relative directory (a third)."""
    ca = certs.parent / "ca"
    if not ca.exists():
        ca.mkdir()
        (ca / "ca.pem").write_bytes((certs / "ca.pem").read_bytes())
    return {"tls": {"cert_file": f"{certs}/{{role}}.pem", "key_file": f"{certs}/{{role}}-key.pem",
                    "ca_file": f"{ca}/ca.pem", "mutual": True, **more.pop("tls", {})},
            "token_file": "./secrets/run.token", **more}


def render_secured(tmp_path: Path, security: dict) -> str:
    """The render of configs/8gpu.yaml with `security`, from a config file in `tmp_path` (the
    containers read the file, so security settings belong in it, not in render-time overrides)."""
    raw = yaml.safe_load((REPO / CONFIG).read_text()) | {"security": security}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return render_compose(load_config(path), str(path))


def test_tls_and_token_files_are_mounted_read_only_and_their_keys_point_inside(tmp_path, certs):
    services = yaml.safe_load(render_secured(tmp_path, secured(certs)))["services"]
    mounts = [f"{certs}:{SECRETS_DIR}/0:ro", f"{certs.parent / 'ca'}:{SECRETS_DIR}/1:ro",
              f"./secrets:{SECRETS_DIR}/2:ro"]
    for role in ROLES:
        service = services[role]
        assert service["volumes"][-3:] == mounts, role
        assert [v for v in service["volumes"] if "/etc/rolefleet" in v] == mounts  # nothing else, nothing twice
        assert {a for a in service["command"] if a.startswith("security.")} == {
            f"security.tls.cert_file={SECRETS_DIR}/0/{{role}}.pem",
            f"security.tls.key_file={SECRETS_DIR}/0/{{role}}-key.pem",
            f"security.tls.ca_file={SECRETS_DIR}/1/ca.pem", f"security.token_file={SECRETS_DIR}/2/run.token"}, role
        # As the container sees it: its own certificate, the CA and the token, all back to the host files.
        name, cfg = container_config(service)
        paths = cfg.security.tls.paths(name)
        assert cfg.security.tls.mutual is True
        assert host_path(service, paths["cert_file"]) == certs / f"{role}.pem"
        assert host_path(service, paths["key_file"]) == certs / f"{role}-key.pem"
        assert host_path(service, paths["ca_file"]) == certs.parent / "ca" / "ca.pem"
        assert host_path(service, cfg.security.token_file) == REPO / "secrets" / "run.token"
        assert "ROLEFLEET_TOKEN" not in service.get("environment", {})  # the file wins: nothing to pass
        # The probe speaks TLS with the role's own certificate, which is also a client certificate.
        test = service["healthcheck"]["test"]
        assert test[:7] == ["CMD", "python", "-m", "rolefleet.deploy.healthcheck", f"127.0.0.1:{GRPC_PORTS[role]}",
                            "--timeout", "5"]
        assert test[7:] == ["--ca", f"{SECRETS_DIR}/1/ca.pem", "--cert", f"{SECRETS_DIR}/0/{role}.pem",
                            "--key", f"{SECRETS_DIR}/0/{role}-key.pem"], role
    # Published ports and the coordinator's wiring stay as they were.
    plain = yaml.safe_load(render())["services"]
    for name in services:
        assert services[name].get("ports") == plain[name].get("ports"), name
    assert services["coordinator"]["environment"] == {"NVIDIA_VISIBLE_DEVICES": "void"}


def test_the_secured_file_passes_docker_compose_config(tmp_path, certs):
    for security in (secured(certs), secured(certs, token_file=None, tls={"server_name": "rolefleet"})):
        path = tmp_path / "docker-compose.yml"
        path.write_text(render_secured(tmp_path, security))
        result = compose_config(path)
        assert result.returncode == 0, result.stderr


def test_without_a_token_file_the_token_comes_from_the_environment_compose_runs_in(tmp_path, certs):
    text = render_secured(tmp_path, secured(certs, token_file=None, token_env="RUN_TOKEN",
                                            tls={"server_name": "rolefleet"}))
    services = yaml.safe_load(text)["services"]
    for role in ROLES:
        environment = services[role]["environment"]
        assert environment["RUN_TOKEN"] == "${RUN_TOKEN:-}", role
        assert not [a for a in services[role]["command"] if a.startswith("security.token_file")]
        assert len([v for v in services[role]["volumes"] if v.startswith(str(certs.parent))]) == 2
        assert services[role]["healthcheck"]["test"][-2:] == ["--server-name", "rolefleet"]
        _, cfg = container_config(services[role])
        assert (cfg.security.token_file, cfg.security.token_env, cfg.security.tls.server_name) == (
            None, "RUN_TOKEN", "rolefleet")
    assert services["coordinator"]["environment"] == {"NVIDIA_VISIBLE_DEVICES": "void", "RUN_TOKEN": "${RUN_TOKEN:-}"}
    # compose fills it in from its own environment, and leaves it empty (no token) without one.
    path = tmp_path / "docker-compose.yml"
    path.write_text(text)
    for environ, expected in (({"RUN_TOKEN": "s3cret-token-0123456789"}, "s3cret-token-0123456789"), ({}, "")):
        done = subprocess.run([tool("docker-compose"), "-f", str(path), "--project-directory", str(REPO), "config",
                               "--format", "json"], capture_output=True, text=True, timeout=60, cwd=REPO,
                              env={k: v for k, v in os.environ.items() if k != "RUN_TOKEN"} | environ)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["services"]["actor"]["environment"]["RUN_TOKEN"] == expected


def test_the_token_variable_passes_through_with_or_without_a_security_section():
    assert yaml.safe_load(render())["services"]["actor"]["environment"] == {"ROLEFLEET_TOKEN": REQUIRED_TOKEN}
    services = yaml.safe_load(render("security.max_calls_per_client=64"))["services"]
    for role in ROLES:
        assert services[role]["environment"]["ROLEFLEET_TOKEN"] == REQUIRED_TOKEN
        assert not [v for v in services[role]["volumes"] if SECRETS_DIR in v]
        assert services[role]["healthcheck"]["test"][-2:] == ["--timeout", "5"]
    services = yaml.safe_load(render("security.max_calls_per_client=64", "security.token_env="))["services"]
    assert "environment" not in services["actor"]  # no variable named: no token, nothing to pass
    assert render() == COMPOSE.read_text()


def test_compose_refuses_to_start_without_the_token_unless_the_config_says_the_run_is_open(tmp_path):
    done = compose_config(COMPOSE, environ={})
    assert done.returncode != 0
    assert "every role needs the token of the run, so put ROLEFLEET_TOKEN=" in done.stderr, done.stderr
    assert compose_config(COMPOSE, environ={"ROLEFLEET_TOKEN": ""}).returncode != 0  # empty is no token either
    assert compose_config(COMPOSE).returncode == 0
    # Open on purpose (in the config file the containers read): the variable is passed when set,
    # nothing is required, and the roles' config lets them start open on all interfaces.
    path = tmp_path / "docker-compose.yml"
    path.write_text(render_secured(tmp_path, {"allow_unauthenticated": True}))
    services = yaml.safe_load(path.read_text())["services"]
    assert services["actor"]["environment"] == {"ROLEFLEET_TOKEN": "${ROLEFLEET_TOKEN:-}"}
    assert compose_config(path, environ={}).returncode == 0
    _, cfg = container_config(services["reward"])
    assert cfg.security.allow_unauthenticated and cfg.reward.host == "0.0.0.0"


def test_one_directory_holding_every_file_is_mounted_once(certs):
    services = yaml.safe_load(render(f"security.tls.cert_file={certs}/{{role}}.pem",
                                     f"security.tls.key_file={certs}/{{role}}-key.pem",
                                     f"security.tls.ca_file={certs}/ca.pem"))["services"]
    assert [v for v in services["reward"]["volumes"] if SECRETS_DIR in v] == [f"{certs}:{SECRETS_DIR}/0:ro"]
    assert services["reward"]["healthcheck"]["test"][7:] == [
        "--ca", f"{SECRETS_DIR}/0/ca.pem", "--cert", f"{SECRETS_DIR}/0/reward.pem", "--key", f"{SECRETS_DIR}/0/reward-key.pem"]


def test_security_paths_compose_cannot_mount_are_refused():
    with pytest.raises(ValueError, match=r"security\.tls\.cert_file: 'certs/\{role\}/tls\.crt': compose mounts one "
                                         r"directory into every role"):
        render("security.tls.cert_file=certs/{role}/tls.crt", "security.tls.key_file=certs/{role}/tls.key")
    with pytest.raises(ValueError, match=r"security\.token_env: 'RUN-TOKEN' is not a variable name"):
        render("security.token_env=RUN-TOKEN")


# --- the healthcheck probe -----------------------------------------------------------------------

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthcheck_exits_0_against_a_serving_role_server(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {model_name_or_path: some/model}\n")
    ready = tmp_path / "ready.json"
    proc = rolefleet("serve", "reward", "--config", str(config), "--ready-file", str(ready))
    try:
        port = wait_ready(proc, ready)["grpc_port"]
        result = healthcheck(f"127.0.0.1:{port}", "--timeout", "10")
        assert (result.returncode, result.stdout.strip()) == (0, f"127.0.0.1:{port}: SERVING"), result.stderr
    finally:
        terminate(proc)


def test_healthcheck_exits_1_with_a_reason_when_nothing_listens_or_the_server_is_not_serving():
    port = closed_port()
    result = healthcheck(f"127.0.0.1:{port}", "--timeout", "3")
    assert result.returncode == 1
    assert re.fullmatch(rf"127\.0\.0\.1:{port}: UNAVAILABLE: .+", result.stderr.strip()), result.stderr

    async def not_serving() -> subprocess.CompletedProcess:
        handle = await start_server("reward", Endpoint(port=0),
                                    lambda s: reward_server.add_to_server(RewardCore(RewardSection()), s))
        try:
            await handle.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            return await asyncio.to_thread(healthcheck, f"127.0.0.1:{handle.grpc_port}")
        finally:
            await handle.stop()

    result = asyncio.run(not_serving())
    assert result.returncode == 1 and result.stderr.strip().endswith(": NOT_SERVING"), result.stderr


def test_healthcheck_usage_errors_exit_1_not_dockers_reserved_2():
    for args in (["localhost"], ["127.0.0.1:1", "--timeout", "0"], [], ["127.0.0.1:1", "--cert", "c.pem"],
                 ["127.0.0.1:1", "--key", "k.pem"], ["127.0.0.1:1", "--server-name", "actor"]):
        result = healthcheck(*args)
        assert result.returncode == 1 and "usage:" in result.stderr, (args, result.stderr)


def test_healthcheck_over_mutual_tls_needs_the_ca_and_a_client_certificate(tmp_path, certs):
    other = tmp_path / "other"  # another CA's certificates
    make_certs(other)
    c = str(certs)

    def tls(*names: str, directory: str = c) -> list[str]:
        return [a for n in names for a in (f"--{n}", f"{directory}/" + {"ca": "ca.pem", "cert": "actor.pem",
                                                                         "key": "actor-key.pem"}[n])]

    async def probes() -> dict[str, subprocess.CompletedProcess]:
        server, port = await mutual_tls_health_server(certs)
        address = f"127.0.0.1:{port}"
        cases = {
            "ca, cert, key": tls("ca", "cert", "key"),
            "and the name the certificate holds": [*tls("ca", "cert", "key"), "--server-name", "reward"],
            "plaintext": [],
            "no client certificate": tls("ca"),
            "another CA": tls("ca", directory=str(other)) + tls("cert", "key"),
            "a client certificate of another CA": tls("ca") + tls("cert", "key", directory=str(other)),
            "a name the certificate lacks": [*tls("ca", "cert", "key"), "--server-name", "critic"],
        }
        try:
            return {case: await asyncio.to_thread(healthcheck, address, "--timeout", "5", *args)
                    for case, args in cases.items()}
        finally:
            await server.stop(None)

    results = asyncio.run(probes())
    for case in ("ca, cert, key", "and the name the certificate holds"):
        result = results[case]
        assert result.returncode == 0 and result.stdout.strip().endswith(": SERVING"), (case, result.stderr)
    for case, result in results.items():
        if case not in ("ca, cert, key", "and the name the certificate holds"):
            reason = result.stderr.strip().splitlines()[-1]
            assert result.returncode == 1 and re.fullmatch(r"127\.0\.0\.1:\d+: UNAVAILABLE: .+", reason), (case, reason)


def test_healthcheck_names_the_flag_and_file_it_cannot_read(tmp_path, certs):
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello\n")
    unreadable = tmp_path / "key.pem"
    unreadable.write_text("-----BEGIN PRIVATE KEY-----\n")
    unreadable.chmod(0)
    port = closed_port()
    cases = [(["--ca", str(tmp_path / "missing.pem")], f"--ca: cannot read {tmp_path}/missing.pem (No such file or directory)"),
             (["--ca", str(not_pem)], f"--ca: {not_pem} is not a PEM file"),
             (["--cert", str(certs / "actor.pem"), "--key", str(tmp_path)], f"--key: cannot read {tmp_path} (Is a directory)")]
    if os.geteuid() != 0:  # root reads any file
        cases.append((["--cert", str(certs / "actor.pem"), "--key", str(unreadable)],
                      f"--key: cannot read {unreadable} (Permission denied)"))
    for args, reason in cases:
        result = healthcheck(f"127.0.0.1:{port}", *args)
        assert (result.returncode, result.stderr.strip()) == (1, f"127.0.0.1:{port}: {reason}"), args


# --- the image's GPU defaults (the container tier builds its CPU variant: tests/containers) -------

def dockerfile() -> str:
    return (REPO / "deploy" / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in dockerfile().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def test_the_dockerfile_pins_its_cuda_base_and_runs_rolefleet_serve_as_a_non_root_user():
    steps = instructions()
    args = {k: v for k, v in (a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)}
    # By default the GPU image (the container tier builds the CPU one for real: tests/containers).
    # CUDA 13.0, as the pinned torch (constraints/gpu-h200.txt: 2.11.0 is PyPI's CUDA 13.0 build);
    # Ubuntu 24.04, whose python3 is the 3.12 the pins ran on.
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-(cudnn-)?runtime-ubuntu24\.04", args["BASE_IMAGE"])
    assert (args["TORCH"], args["EXTRAS"]) == ("cuda", "vllm")
    stages = [a for kind, a in steps if kind == "FROM"]
    assert stages[0] == "${BASE_IMAGE} AS system" and stages[-1] == "system"
    entry = [a for kind, a in steps if kind == "ENTRYPOINT"]
    assert [json.loads(a) for a in entry] == [["rolefleet", "serve"]]
    users = [a for kind, a in steps if kind == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    env = " ".join(a for kind, a in steps if kind == "ENV")
    assert "HF_HUB_OFFLINE=1" in env and "CUDA_VISIBLE_DEVICES" not in dockerfile()


def test_the_dockerfile_installs_the_project_with_its_extras_from_files_the_build_context_keeps():
    steps = instructions()
    runs = [a for kind, a in steps if kind == "RUN"]
    assert any(re.search(r'pip install --find-links /wheelhouse "/src\$\{EXTRAS:\+\[\$EXTRAS\]\}"', r) for r in runs), runs
    assert any(re.search(r"pip install --no-deps .*/src", r) for r in runs), runs  # the real sources, last
    assert any("torch.version.cuda" in r and "$TORCH" in r for r in runs)  # the wrong torch build fails the build
    copied = [src for kind, a in steps if kind == "COPY" and "--from=" not in a for src in a.split()[:-1]]
    assert set(copied) == {"pyproject.toml", "README.md", "services", "deploy/wheelhouse", "constraints/gpu-h200.txt"}
    assert (REPO / "deploy" / "wheelhouse").is_dir()  # a clean clone has it (its README), so COPY finds it
    ignored = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    assert {".git", ".venv", "runs", "models", ".tools"} <= set(ignored)
    assert not [p for p in ignored if p.rstrip("/") in copied or p in ("*", "services/*")]


def test_snapshots_go_to_a_memory_volume_every_role_container_mounts():
    """A container's own /dev/shm is small and gone with its restart: the snapshots (checkpoint.snapshot)
    go to a tmpfs volume that outlives a role container's restart, at a path every role is told."""
    rendered = yaml.safe_load(render())
    assert rendered["volumes"]["snapshots"] == {"driver": "local", "driver_opts": {"type": "tmpfs", "device": "tmpfs"}}
    for name in ("coordinator", "actor", "critic", "reward"):
        service = rendered["services"][name]
        assert "snapshots:/snapshots" in service["volumes"], name
        assert "checkpoint.snapshot.dir=/snapshots/8gpu" in service["command"], name
    off = yaml.safe_load(render("checkpoint.snapshot.enabled=false"))
    assert "snapshots" not in off["volumes"]
    for service in (s for s in off["services"].values() if "command" in s):
        assert "snapshots:/snapshots" not in service["volumes"]
        assert not any(word.startswith("checkpoint.snapshot.dir=") for word in service["command"])
    with pytest.raises(ValueError, match="compose sets checkpoint.snapshot.dir itself"):
        render("checkpoint.snapshot.dir=/elsewhere")


def test_a_distillation_run_gets_a_teacher_service_on_its_gpus_and_the_coordinator_dials_it():
    overrides = ["algorithm=distill", "teacher.model_name_or_path=models/teacher", "devices.critic=[]",
                 "devices.teacher=[6, 7]"]
    cfg = load_config(REPO / CONFIG, overrides)
    services = yaml.safe_load(render_compose(cfg, CONFIG, overrides))["services"]
    assert "critic" not in services
    teacher = services["teacher"]
    assert [r["device_ids"] for r in reservations(teacher)] == [["6", "7"]]
    values = command_values(teacher)
    assert values["teacher.model_name_or_path"] == "/models/teacher" and values["teacher.port"] == "50054"
    assert values["actor.model_name_or_path"] == "/models/policy"  # the student's tokenizer, checked at start
    assert command_values(services["coordinator"])["teacher.address"] == "teacher:50054"

"""docker-compose.yml, the container image and its healthcheck probe.

The compose file is generated from configs/8gpu.yaml and must stay a fresh render of it; it must pass
`docker compose config`; its GPU reservations must be the config's devices map; each service's
command must load as a valid config inside its container. The probe is run against a real role
server. The Dockerfile cannot be built here (a Docker client, no engine), so it is only read: its
base is pinned, it installs the project with vLLM, it runs `rolefleet serve` as a non-root user.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml
from grpc_health.v1 import health_pb2

from rolefleet.common.config import Endpoint, RewardSection, load_config
from rolefleet.common.preflight import MODEL_KEYS
from rolefleet.common.server import start_server
from rolefleet.deploy.compose import render_compose
from rolefleet.reward import server as reward_server
from rolefleet.reward.core import RewardCore
from tests.deploy.tools import REPO, tool
from tests.e2e.procs import rolefleet, terminate, wait_ready

CONFIG = "configs/8gpu.yaml"
COMPOSE = REPO / "docker-compose.yml"
REGENERATE = f"rolefleet deploy compose {CONFIG} > docker-compose.yml"
# The port convention every deployment shares (compose, the Helm chart, prometheus.yml).
GRPC_PORTS = {"coordinator": 50050, "actor": 50051, "reward": 50052, "critic": 50053}
METRICS_PORTS = {"coordinator": 9100, "actor": 9101, "reward": 9102, "critic": 9103}
MONITORING = {"prometheus", "grafana"}


def render(*overrides: str) -> str:
    return render_compose(load_config(REPO / CONFIG, list(overrides)), CONFIG)


def committed() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def reservations(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def compose_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("docker-compose"), "-f", str(path), "--project-directory", str(REPO), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


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
    for role in ("actor", "reward", "critic"):
        [reservation] = reservations(services[role])
        assert reservation == {"driver": "nvidia", "device_ids": [str(i) for i in getattr(cfg.devices, role)],
                               "capabilities": ["gpu"]}, role
        assert "CUDA_VISIBLE_DEVICES" not in json.dumps(services[role])  # the reservation alone picks the GPUs
    for name in ("coordinator", *MONITORING):
        assert reservations(services[name]) == [] and "gpus" not in services[name], name
    assert services["coordinator"]["environment"] == {"NVIDIA_VISIBLE_DEVICES": "void"}


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
    with pytest.raises(ValueError, match=r"devices\.actor: node0:0"):
        render("devices.actor=['node0:0', 1, 2, 3]", "devices.rollout=[1]")


def test_a_model_outside_the_mounted_models_directory_is_refused():
    with pytest.raises(ValueError, match=r"model\.model_name_or_path: 'Qwen/Qwen2-1\.5B' is outside \./models"):
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


def test_the_coordinator_waits_for_healthy_roles_and_publishes_on_loopback_only():
    services = committed()["services"]
    assert services["coordinator"]["depends_on"] == {r: {"condition": "service_healthy"}
                                                     for r in ("actor", "reward", "critic")}
    # A dead role comes back and the run carries on; a run that ended is not started over its outputs.
    assert {n: services[n]["restart"] for n in GRPC_PORTS} == {
        "coordinator": "no", "actor": "unless-stopped", "reward": "unless-stopped", "critic": "unless-stopped"}
    published = {name: s.get("ports", []) for name, s in services.items()}
    assert published == {"actor": [], "reward": [], "critic": [],
                         "coordinator": ["127.0.0.1:8080:8080", "127.0.0.1:50050:50050"],
                         "prometheus": ["127.0.0.1:9090:9090"], "grafana": ["127.0.0.1:3000:3000"]}
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
    for name in MONITORING:  # pinned, never `latest`
        assert re.fullmatch(r"[a-z/]+:v?\d+\.\d+\.\d+", services[name]["image"]), services[name]["image"]


# --- the healthcheck probe -----------------------------------------------------------------------

def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolefleet.deploy.healthcheck", *args],
                          capture_output=True, text=True, timeout=30)


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
    for args in (["localhost"], ["127.0.0.1:1", "--timeout", "0"], []):
        result = healthcheck(*args)
        assert result.returncode == 1 and "usage:" in result.stderr, (args, result.stderr)


# --- the image (read, not built: there is no Docker engine here) ---------------------------------

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
    [base] = [a for kind, a in steps if kind == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-(cudnn-)?runtime-ubuntu2[24]\.04", base), base
    entry = [a for kind, a in steps if kind == "ENTRYPOINT"]
    assert [json.loads(a) for a in entry] == [["rolefleet", "serve"]]
    users = [a for kind, a in steps if kind == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    env = " ".join(a for kind, a in steps if kind == "ENV")
    assert "HF_HUB_OFFLINE=1" in env and "CUDA_VISIBLE_DEVICES" not in dockerfile()


def test_the_dockerfile_installs_the_project_with_its_vllm_extra_from_files_the_build_context_keeps():
    steps = instructions()
    runs = [a for kind, a in steps if kind == "RUN"]
    assert any(re.search(r"pip install [\"']?\.\[vllm\][\"']?", r) for r in runs), runs
    assert any(re.search(r"pip install .*--no-deps.* \.(\s|$)", r) for r in runs), runs  # the real sources, last
    assert any("torch.version.cuda" in r for r in runs)  # a CPU-only torch fails the build
    copied = [src for kind, a in steps if kind == "COPY" for src in a.split()[:-1] if not src.startswith("--")]
    assert set(copied) == {"pyproject.toml", "README.md", "services"}
    ignored = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    assert {".git", ".venv", "runs", "models", ".tools"} <= set(ignored)
    assert not [p for p in ignored if p.rstrip("/") in copied or p in ("*", "services/*")]

"""The chart's snapshot volume (`checkpoint.snapshot`, docs/deploy-kubernetes.md "The snapshot
volume"): the actor, critic and coordinator pods, every pod of a spanning trainer too, get a
memory-backed emptyDir at /snapshots and `checkpoint.snapshot.dir` on it; none when the config turns
snapshots off. And its size, with the trainers' memory requests, from `rolefleet deploy helm-values`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rolefleet.app.memory import GIB, ModelDims
from rolefleet.cli import parse_args
from rolefleet.common.config import load_config, parse_config
from rolefleet.deploy import sizing
from rolefleet.deploy.helm import render_values, values_for
from tests.deploy.test_helm import (
    CHART,
    MODEL_VOLUME,
    PREFIX,
    default_config,
    failure,
    find,
    render,
    write,
)
from tests.deploy.test_helm_multinode import four_node_run, rendered, validate
from tests.deploy.test_sizing import QWEN2_1_5B, model_dir

pytestmark = pytest.mark.procs

SNAPSHOT_ROLES = ("actor", "critic", "coordinator")
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def pods(docs: list[dict]) -> dict[str, tuple[str, dict]]:
    """Each role's (workload kind, pod spec), by the workload's component label."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: (d["kind"], d["spec"]["template"]["spec"])
            for d in docs if d["kind"] in WORKLOADS}


def snapshot_parts(spec: dict) -> tuple[list[dict], list[dict], list[str]]:
    """A pod's snapshot volumes, the container's mounts of them, and its checkpoint.snapshot overrides."""
    (c,) = spec["containers"]
    volumes = [v for v in spec["volumes"] if v["name"] == "snapshots"]
    mounts = [m for m in c["volumeMounts"] if m["name"] == "snapshots"]
    return volumes, mounts, [a for a in c["args"] if a.startswith("checkpoint.snapshot.")]


def snapshot_root(docs: list[dict], spec: dict, tmp_path: Path) -> Path:
    """Where the role's `rolefleet serve` puts its snapshots: the config of the render with the
    pod's arguments, loaded as the role loads them."""
    config = write(tmp_path / "config.yaml", find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    (c,) = spec["containers"]
    args = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in c["args"]])
    cfg = load_config(args.config, args.overrides)
    return cfg.checkpoint.snapshot.root(cfg.run)


def check_snapshot_volumes(docs: list[dict], size: str, tmp_path: Path) -> None:
    """The trainers and the coordinator: the memory volume at /snapshots and the one snapshot path
    on it (the coordinator names paths under its root that each trainer must find under its own);
    the reward role: none of it."""
    by_role = pods(docs)
    for role in SNAPSHOT_ROLES:
        spec = by_role[role][1]
        volumes, mounts, args = snapshot_parts(spec)
        assert volumes == [{"name": "snapshots", "emptyDir": {"medium": "Memory", "sizeLimit": size}}], role
        assert mounts == [{"name": "snapshots", "mountPath": "/snapshots"}], role
        assert args == ["checkpoint.snapshot.dir=/snapshots/8gpu"], role
        root = snapshot_root(docs, spec, tmp_path)
        # Not the config's default in /dev/shm: there a pod has the shm volume, sized for NCCL.
        assert root == Path("/snapshots/8gpu") and not root.is_relative_to("/dev/shm"), role
    assert snapshot_parts(by_role["reward"][1]) == ([], [], [])


def gib(quantity: str) -> int:
    return int(quantity.removesuffix("Gi")) * GIB


def without_snapshots(raw: dict) -> dict:
    return raw | {"checkpoint": {"snapshot": {"enabled": False}}}


def test_the_default_run_gives_trainers_and_coordinator_a_memory_volume_for_snapshots(tmp_path):
    docs = render()
    check_snapshot_volumes(docs, "64Gi", tmp_path)
    assert {role: kind for role, (kind, _) in pods(docs).items()} == {
        "actor": "Deployment", "critic": "Deployment", "reward": "Deployment", "coordinator": "Job"}


def test_every_pod_of_spanning_trainers_gets_the_volume(tmp_path):
    """A four-node run: the actor's and the critic's StatefulSets (each pod writes its ranks' shards
    on its own node), from the helm-values of its config."""
    raw = four_node_run()
    docs = rendered(tmp_path, raw)
    validate(docs)
    assert {r: k for r, (k, _) in pods(docs).items() if r != "reward"} == {
        "actor": "StatefulSet", "critic": "StatefulSet", "coordinator": "Job"}
    check_snapshot_volumes(docs, "64Gi", tmp_path)  # the model is not readable here: the chart's default


@pytest.mark.parametrize("raw", [default_config(), four_node_run()], ids=["one node", "four nodes"])
def test_no_volume_and_no_override_when_the_config_turns_snapshots_off(tmp_path, raw):
    raw = without_snapshots(raw)
    values = yaml.safe_load(render_values(parse_config(raw)))
    assert values["snapshots"] == {"enabled": False}
    docs = rendered(tmp_path, raw)
    validate(docs)
    for role, (_, spec) in pods(docs).items():
        assert snapshot_parts(spec) == ([], [], []), role
    config = write(tmp_path / "run.yaml", raw)
    assert not any(snapshot_parts(spec)[0] for _, spec in pods(render("--set-file", f"config={config}")).values())


def test_snapshots_enabled_must_repeat_the_config(tmp_path):
    assert ("snapshots.enabled is false but the run config's checkpoint.snapshot.enabled is true"
            in failure("--set", "snapshots.enabled=false"))
    config = write(tmp_path / "run.yaml", without_snapshots(default_config()))
    assert ("snapshots.enabled is true but the run config's checkpoint.snapshot.enabled is false"
            in failure("--set-file", f"config={config}", "--set", "snapshots.enabled=true"))
    check_snapshot_volumes(render("--set", "snapshots.enabled=true", "--set", "snapshots.sizeLimit=100Gi"),
                           "100Gi", tmp_path)
    assert "/snapshots/sizeLimit" in failure("--set", "snapshots.sizeLimit=lots")


# --- sizing -------------------------------------------------------------------------------------

@pytest.fixture
def qwen(tmp_path) -> tuple[str, ModelDims]:
    path = model_dir(tmp_path / "qwen", QWEN2_1_5B)
    return path, ModelDims.read(path)


def test_a_trainer_pod_holds_two_snapshots_of_its_share_of_the_state(qwen):
    """The newest kept and the next written beside it;
    FSDP over N pods: each pod its 1/N of 12 bytes a trainable parameter."""
    path, dims = qwen
    raw = default_config() | {"model": {"model_name_or_path": path}}
    cfg = parse_config(raw)
    actor = 12 * dims.params + 4 * 151936 * 1536  # the tied head saved under its own name too
    critic = 12 * (dims.params + 1536 + 1)
    assert sizing.snapshot_bytes(cfg, "actor") == 2 * (actor + sizing.TRAINER_FILES_BYTES)
    assert sizing.snapshot_bytes(cfg, "critic") == 2 * (critic + sizing.TRAINER_FILES_BYTES)
    spanning = parse_config(four_node_run() | {"model": {"model_name_or_path": path}})
    assert sizing.snapshot_bytes(spanning, "actor") == pytest.approx(2 * (actor / 2 + sizing.TRAINER_FILES_BYTES))
    replicated = parse_config(raw | {"critic": raw["critic"] | {"sharding": "replicate"}})
    assert sizing.snapshot_bytes(replicated, "critic") == sizing.snapshot_bytes(cfg, "critic")  # any rank may write it
    assert sizing.snapshot_bytes(parse_config(without_snapshots(raw)), "actor") == 0
    assert sizing.snapshot_bytes(parse_config(default_config() | {"model": {"model_name_or_path": "gone"}}),
                                 "actor") is None


def test_trainer_memory_requests_count_their_snapshots(qwen):
    path, _ = qwen
    raw = default_config() | {"model": {"model_name_or_path": path}}
    cfg, off = parse_config(raw), parse_config(without_snapshots(raw))
    for role in ("actor", "critic"):
        # Two on the memory volume (the trainer copies the next one into the second: nothing else staged).
        with_snapshots = sizing.trainer_memory(cfg, role) + sizing.snapshot_bytes(cfg, role)
        assert sizing.requests(cfg)[role]["memory"] == sizing.gib(with_snapshots), role
        assert sizing.requests(off)[role]["memory"] == sizing.gib(sizing.trainer_memory(off, role)), role
    assert sizing.requests(cfg)["coordinator"] == sizing.requests(off)["coordinator"]  # its part is KBs


def test_helm_values_size_the_volume_and_the_chart_defaults_hold_the_default_run(tmp_path, qwen, monkeypatch):
    """helm-values of the default run on a 1.5B model: the fullest trainer pod's volume, which the
    chart's defaults (volume and memory requests) hold; rendered, it reaches every snapshot pod."""
    monkeypatch.chdir(tmp_path)
    model_dir(tmp_path / "models" / "qwen", QWEN2_1_5B)
    raw = default_config() | {"model": {"model_name_or_path": "models/qwen"}}
    cfg = parse_config(raw)
    values = values_for(cfg)
    fullest = max(sizing.snapshot_bytes(cfg, role) for role in ("actor", "critic"))
    assert values["snapshots"] == {"enabled": True, "sizeLimit": sizing.gib(fullest)}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert gib(defaults["snapshots"]["sizeLimit"]) >= fullest
    for role in ("actor", "critic"):
        asked = gib(defaults[role]["resources"]["requests"]["memory"])
        assert asked >= gib(values[role]["resources"]["requests"]["memory"]), role
    docs = render("--set-file", f"config={write(tmp_path / 'run.yaml', raw)}",
                  "-f", str(write(tmp_path / "values.yaml", render_values(cfg))), *MODEL_VOLUME)
    validate(docs)
    check_snapshot_volumes(docs, values["snapshots"]["sizeLimit"], tmp_path)


def test_helm_values_say_when_the_volume_is_not_sized():
    text = render_values(parse_config(default_config()))  # /models/policy is not readable here
    assert yaml.safe_load(text)["snapshots"] == {"enabled": True}
    assert "# snapshots.sizeLimit: not estimated" in text
    assert "snapshots.sizeLimit" not in render_values(parse_config(without_snapshots(default_config())))

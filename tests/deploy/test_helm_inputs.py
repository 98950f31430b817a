"""Every model and file a role reads reaches its pod: `rolefleet deploy helm-values` points each role's
inputs (`rolefleet.deploy.inputs.role_inputs`) at the chart's model and inputs volumes, rendered by the
real helm and loaded as each pod's `rolefleet serve` loads its config."""

from __future__ import annotations

import json
import re
import shutil
from contextlib import chdir
from pathlib import Path

import pytest
import yaml

from rolefleet.cli import main, parse_args
from rolefleet.common.config import RoleFleetConfig, load_config, overridden
from rolefleet.deploy.inputs import role_inputs
from tests.deploy.test_helm import CHART, DOC, PREFIX, container, failure, find, pod, render, workload, write
from tests.deploy.tools import REPO

pytestmark = pytest.mark.procs

CONFIGS = REPO / "configs"
# What each shipped config needs to be deployable with the chart: its model under ./models (the
# model volume), its files under ./inputs (the inputs volume). None of them is refused by the chart
# for another reason: the CPU ones run with 0 GPUs a pod, the colocated ones get separate GPUs.
TO_POLICY = ["model.model_name_or_path=models/policy"]
DEPLOYABLE = {
    "2gpu.yaml": TO_POLICY,
    "2gpu_colocated.yaml": TO_POLICY,
    "2gpu_rollout.yaml": TO_POLICY,
    "8gpu.yaml": [],  # models/policy already
    "demo.yaml": TO_POLICY,
    "demo_agent.yaml": [*TO_POLICY, "reward.agent.path=inputs/calculator_agent.py:agent"],
    "demo_grpo.yaml": TO_POLICY,
    "demo_openenv.yaml": [*TO_POLICY, "reward.agent.openenv.environment=inputs/echo_task/server/env.py:EchoEnv"],
    "demo_tools.yaml": TO_POLICY,
    "gpu_1x.yaml": TO_POLICY,
    "gpu_7b.yaml": TO_POLICY,
    "gpu_tools.yaml": TO_POLICY,
    "gsm8k.yaml": ["data.path=inputs/gsm8k_sample.jsonl", "eval.path=inputs/eval.jsonl"],  # models/chat-model already
    "smollm2_arithmetic.yaml": TO_POLICY,
    "smollm2_distill.yaml": [*TO_POLICY, "teacher.model_name_or_path=models/teacher"],
    "tools_warm_start.yaml": TO_POLICY,
}
VOLUMES = ["--set", "model.existingClaim=models", "--set", "inputs.hostPath=/data/inputs"]
MOUNTS = {"models": "/models", "inputs": "/inputs"}


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Where helm-values runs: ./models and ./inputs as the volumes hold them (the config check
    opens data and eval files, so they exist; models need not)."""
    (tmp_path / "inputs" / "rewards").mkdir(parents=True)
    (tmp_path / "models").mkdir()
    shutil.copy(REPO / "examples" / "gsm8k_sample.jsonl", tmp_path / "inputs" / "gsm8k_sample.jsonl")
    for name in ("train.jsonl", "eval.jsonl"):
        shutil.copy(REPO / "examples" / "gsm8k_sample.jsonl", tmp_path / "inputs" / name)
    shutil.copy(REPO / "examples" / "agents" / "calculator_agent.py", tmp_path / "inputs" / "calculator_agent.py")
    (tmp_path / "inputs" / "rewards" / "exact.py").write_text("def score(response, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def helm_values(config: Path, overrides: list[str], capsys) -> tuple[int, str, str]:
    """`rolefleet deploy helm-values CONFIG OVERRIDES`: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main(["deploy", "helm-values", str(config), *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def deploy(workdir: Path, config: Path, overrides: list[str], capsys, *more: str) -> tuple[RoleFleetConfig, list]:
    """The run config as helm-values sees it, and the chart rendered as the docs install it: the config
    (overrides applied) by --set-file, helm-values' output by -f, both volumes set."""
    code, out, err = helm_values(config, overrides, capsys)
    assert code == 0, err
    run = write(workdir / "run.yaml", yaml.safe_dump(overridden(config, overrides), sort_keys=False))
    values = write(workdir / "values.yaml", out)
    docs = render("--set-file", f"config={run}", "-f", str(values), *VOLUMES, *more)
    return load_config(config, overrides), docs


def pod_config(docs: list, role: str, workdir: Path) -> RoleFleetConfig:
    """The config `rolefleet serve ROLE` of the pod loads, the pod's volumes standing at
    workdir/models and workdir/inputs (what helm-values' ./models and ./inputs were copied onto), from
    a directory where no relative path of the host resolves."""
    mounts = {m["name"]: m["mountPath"] for m in container(docs, role)["volumeMounts"]}
    args = container(docs, role)["args"]
    for name, path in MOUNTS.items():
        assert mounts.get(name) == path, f"{role} mounts no {name} volume at {path}: {mounts}"
        args = [re.sub(rf'(?<=[="]){re.escape(path)}(?=[/":]|$)', str(workdir / name), a) for a in args]
    config = write(workdir / f"{role}.yaml", find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"])
    parsed = parse_args([a.replace("/etc/rolefleet/config.yaml", str(config)) for a in args])
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    with chdir(elsewhere):
        return load_config(parsed.config, parsed.overrides)


def assert_every_input_on_a_volume(cfg: RoleFleetConfig, docs: list, workdir: Path) -> None:
    """Each role pod reads every item of role_inputs at the volume path of its ./models or ./inputs
    path, and mounts that volume (read-only, from the claim or directory the values name)."""
    assert role_inputs(cfg, "actor") and role_inputs(cfg, "coordinator")  # a model each, at least
    for role in cfg.roles():
        spec = pod(docs, role)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert volumes["inputs"]["hostPath"] == {"path": "/data/inputs", "type": "Directory"}
        assert all(m["readOnly"] for m in container(docs, role)["volumeMounts"] if m["name"] in MOUNTS)
        here = role_inputs(cfg, role)
        there = role_inputs(pod_config(docs, role, workdir), role)
        assert [i.key for i in there] == [i.key for i in here], role
        for host, inside in zip(here, there):
            assert Path(host.path).parts[0] == ("models" if host.kind == "model" else "inputs"), host
            assert inside.path == str(workdir / host.path), (role, host, inside)


@pytest.mark.parametrize("name", sorted(DEPLOYABLE))
def test_every_shipped_config_reads_each_input_from_a_volume_in_every_pod(workdir, capsys, name):
    cfg, docs = deploy(workdir, CONFIGS / name, DEPLOYABLE[name], capsys)
    assert_every_input_on_a_volume(cfg, docs, workdir)


def test_every_shipped_config_is_checked():
    assert sorted(DEPLOYABLE) == sorted(p.name for p in CONFIGS.glob("*.yaml"))


CHAT = ["algorithm=ppo", "data.path=inputs/train.jsonl", "eval.path=inputs/eval.jsonl",
        "critic.model_name_or_path=models/value",
        "reward.sources=" + json.dumps([{"name": "correct", "kind": "function", "function": "math"},
                                        {"name": "format", "kind": "function", "function": "format",
                                         "pattern": "(?s).*####\\s*-?[0-9]+\\s*", "weight": 0.1},
                                        {"name": "exact", "kind": "user", "path": "inputs/rewards/exact.py:score"}])]


def test_a_chat_run_gets_each_file_and_model_in_the_pods_that_read_it_only(workdir, capsys):
    cfg, docs = deploy(workdir, CONFIGS / "gsm8k.yaml", CHAT, capsys)
    assert_every_input_on_a_volume(cfg, docs, workdir)
    args = {role: container(docs, role)["args"] for role in cfg.roles()}
    assert set(args) == {"actor", "reward", "critic", "coordinator"}
    for role, argv in args.items():
        assert "data.path=/inputs/train.jsonl" in argv and "eval.path=/inputs/eval.jsonl" in argv, role
        assert ("critic.model_name_or_path=/models/value" in argv) == (role == "critic"), role
        assert any("/models/value" in a for a in argv) == (role == "critic"), role
        assert any("exact.py" in a for a in argv) == (role == "reward"), role
        assert ("actor.model_name_or_path=/models/chat-model" in argv) == (role in ("actor", "coordinator")), role
    (sources,) = [a.partition("=")[2] for a in args["reward"] if a.startswith("reward.sources=")]
    assert json.loads(sources)[2]["path"] == "/inputs/rewards/exact.py:score"
    assert json.loads(sources)[1]["pattern"] == "(?s).*####\\s*-?[0-9]+\\s*"  # the rest of the list kept
    assert pod_config(docs, "reward", workdir).reward.sources[2].path == f"{workdir}/inputs/rewards/exact.py:score"


def test_inputs_come_before_the_users_extra_args_which_win_and_survive_another_values_file(workdir, capsys):
    more = write(workdir / "mine.yaml", {"critic": {"extraArgs": ["critic.model_name_or_path=/models/other"]}})
    cfg, docs = deploy(workdir, CONFIGS / "gsm8k.yaml", CHAT, capsys, "-f", str(more))
    argv = container(docs, "critic")["args"]
    assert argv[-1] == "critic.model_name_or_path=/models/other"
    assert argv.index("critic.model_name_or_path=/models/value") < len(argv) - 1
    assert pod_config(docs, "critic", workdir).critic.model_name_or_path == f"{workdir}/models/other"
    assert "data.path=/inputs/train.jsonl" in argv  # the extraArgs of another file did not drop them


@pytest.mark.parametrize("override, key, path, directory", [
    ("model.model_name_or_path=runs/qwen2-0.5b", "actor.model_name_or_path", "runs/qwen2-0.5b", "models"),
    ("model.model_name_or_path=Qwen/Qwen2-0.5B", "actor.model_name_or_path", "Qwen/Qwen2-0.5B", "models"),
    ("critic.model_name_or_path=/abs/value", "critic.model_name_or_path", "/abs/value", "models"),
    ("data.path=examples/gsm8k_sample.jsonl", "data.path", "examples/gsm8k_sample.jsonl", "inputs"),
])
def test_an_input_outside_models_or_inputs_is_a_config_error_naming_the_key(workdir, capsys, override, key, path,
                                                                             directory):
    (workdir / "examples").mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "gsm8k_sample.jsonl", workdir / "examples")
    code, out, err = helm_values(CONFIGS / "gsm8k.yaml", ["algorithm=ppo", "data.path=inputs/train.jsonl",
                                                         "eval.path=inputs/eval.jsonl", override], capsys)
    assert code == 2 and not out
    assert err.startswith(f"rolefleet: {key}: {path!r} is outside ./{directory}"), err
    volume = "model" if directory == "models" else "inputs"
    assert f"put it under ./{directory}, copied onto the volume that {volume}.existingClaim or {volume}.hostPath" in err


def test_a_hub_dataset_id_is_refused_with_how_to_make_a_local_copy(workdir, capsys):
    """The images read no hub (HF_HUB_OFFLINE=1): a dataset id would fail in every pod at start."""
    code, out, err = helm_values(CONFIGS / "gsm8k.yaml", ["data.path=openai/gsm8k", "data.name=main",
                                                         "eval.path=inputs/eval.jsonl"], capsys)
    assert code == 2 and not out
    assert err.startswith("rolefleet: data.path: 'openai/gsm8k' is a hub dataset id, and a deployment's roles read "
                          "no hub (HF_HUB_OFFLINE=1 in the image): prepare a local copy"), err
    assert "datasets.load_dataset('openai/gsm8k', 'main').save_to_disk(DIR)" in err


def test_user_code_outside_inputs_is_refused(workdir, capsys):
    sources = json.dumps([{"name": "exact", "kind": "user", "path": "rewards/exact.py:score"}])
    (workdir / "rewards").mkdir()
    shutil.copy(workdir / "inputs" / "rewards" / "exact.py", workdir / "rewards")
    code, _, err = helm_values(CONFIGS / "8gpu.yaml", [f"reward.sources={sources}"], capsys)
    assert code == 2 and "reward.sources.0.path: 'rewards/exact.py' is outside ./inputs" in err, err


def test_the_chart_refuses_inputs_on_no_volume(workdir, capsys):
    """helm-values' paths need the volumes at the mount paths it mapped to: without the inputs volume,
    or with the model volume elsewhere, the render fails naming the value."""
    code, out, _ = helm_values(CONFIGS / "gsm8k.yaml", CHAT, capsys)
    assert code == 0
    values = str(write(workdir / "values.yaml", out))
    err = failure("-f", values, "--set", "model.hostPath=/data/models")
    assert "inputs.existingClaim or inputs.hostPath" in err and "reads /inputs/train.jsonl" in err, err
    err = failure("-f", values, *VOLUMES, "--set", "model.mountPath=/mnt/models")
    assert "reads /models/chat-model, which is on no volume the pod mounts" in err, err
    err = failure("-f", values, "--set", "inputs.hostPath=/data/inputs")
    assert "reads /models/chat-model" in err, err


def test_the_chart_refuses_model_path_beside_input_args(workdir, capsys):
    """helm-values names every model per role and empties model.path; a model.path set again would be
    overridden by them without a word."""
    code, out, _ = helm_values(CONFIGS / "8gpu.yaml", [], capsys)
    values = yaml.safe_load(out)
    assert code == 0 and values["model"] == {"path": ""}
    path = str(write(workdir / "values.yaml", out))
    err = failure("-f", path, *VOLUMES, "--set", "model.path=/models/qwen")
    assert "model.path is /models/qwen, but" in err and "inputArgs" in err, err


def test_without_helm_values_model_path_still_reaches_every_role():
    docs = render("--set", "model.existingClaim=models", "--set", "model.path=/models/qwen")
    for role in ("actor", "reward", "critic", "coordinator"):
        assert "model.model_name_or_path=/models/qwen" in container(docs, role)["args"]
        assert not [m for m in container(docs, role)["volumeMounts"] if m["name"] == "inputs"]
    assert workload(docs, "coordinator")["kind"] == "Job"


@pytest.mark.parametrize("flags, at, source", [
    (["--set", "inputs.existingClaim=data"], "/inputs", {"persistentVolumeClaim": {"claimName": "data", "readOnly": True}}),
    (["--set", "inputs.hostPath=/srv/in", "--set", "inputs.mountPath=/in"], "/in",
     {"hostPath": {"path": "/srv/in", "type": "Directory"}}),
])
def test_the_inputs_volume_is_mounted_read_only_in_every_role_when_set(flags, at, source):
    docs = render(*flags)
    for role in ("actor", "reward", "critic", "coordinator"):
        (mount,) = [m for m in container(docs, role)["volumeMounts"] if m["name"] == "inputs"]
        assert mount == {"name": "inputs", "mountPath": at, "readOnly": True}
        (volume,) = [v for v in pod(docs, role)["volumes"] if v["name"] == "inputs"]
        assert {k: v for k, v in volume.items() if k != "name"} == source


def test_the_chart_defaults_are_the_mount_paths_helm_values_maps_to():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (values["model"]["mountPath"], values["inputs"]["mountPath"]) == (MOUNTS["models"], MOUNTS["inputs"])


def test_the_docs_say_how_files_reach_the_pods():
    text = DOC.read_text()
    assert "inputs.existingClaim" in text and "inputArgs" in text and "is outside ./inputs" in text


def test_helm_values_with_overrides_carries_the_overridden_config_into_the_chart(workdir, capsys):
    """`deploy helm-values CONFIG key=value` writes the config with the overrides applied as the
    chart's `config` value: installed with that values file alone, every pod reads them."""
    config = REPO / "configs" / "8gpu.yaml"
    code, out, err = helm_values(config, ["train.total_steps=7", "actor.lr=2e-6"], capsys)
    assert code == 0, err
    docs = render("-f", str(write(workdir / "values.yaml", out)), *VOLUMES)
    text = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]["config.yaml"]
    assert yaml.safe_load(text) == overridden(config, ["train.total_steps=7", "actor.lr=2e-6"])
    assert yaml.safe_load(text)["train"]["total_steps"] == 7


def test_a_distillation_run_s_teacher_pod_reads_its_model_and_the_student_s(workdir, capsys):
    """The teacher loads its model and checks it against the student's tokenizer: both on the model
    volume in its pod, its GPUs the devices map's."""
    overrides = [*TO_POLICY, "algorithm=distill", "teacher.model_name_or_path=models/teacher",
                 "devices={actor: [0, 1], teacher: [2]}"]
    cfg, docs = deploy(workdir, CONFIGS / "demo.yaml", overrides, capsys)
    assert cfg.roles() == ["actor", "reward", "teacher", "coordinator"]
    assert_every_input_on_a_volume(cfg, docs, workdir)
    assert [i.key for i in role_inputs(cfg, "teacher")] == ["teacher.model_name_or_path", "actor.model_name_or_path"]
    limits = container(docs, "teacher")["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1

"""The chart's CPU and memory requests (no role pod is BestEffort) and its runs volume sized for the
run's checkpoints: the values `rolefleet deploy helm-values` writes, rendered by the real helm."""

from __future__ import annotations

import pytest
import yaml

from rolefleet.common.config import parse_config
from rolefleet.common.config.run import CheckpointSection
from rolefleet.deploy.helm import render_values, values_for
from tests.deploy.test_helm import (
    CHART,
    DOC,
    GRPC_PORTS,
    MODEL_VOLUME,
    PREFIX,
    container,
    default_config,
    failure,
    find,
    notes,
    render,
    two_node_config,
    write,
)
from tests.deploy.test_sizing import QWEN2_1_5B, model_dir

pytestmark = pytest.mark.procs

POD_KINDS = {"Deployment", "StatefulSet", "Job"}


def role_requests(docs: list[dict]) -> dict[str, dict]:
    """Each role pod's container requests, by the workload's component label."""
    out = {}
    for doc in docs:
        if doc["kind"] in POD_KINDS:
            (only,) = doc["spec"]["template"]["spec"]["containers"]
            out[doc["metadata"]["labels"]["app.kubernetes.io/component"]] = only.get("resources", {}).get("requests", {})
    return out


def spanning_actor() -> dict:
    raw = default_config()
    raw["devices"] = {"actor": ["node0:0", "node0:1", "node1:0", "node1:1"], "critic": ["node2:0"]}
    return raw


@pytest.mark.parametrize("case", ["chart defaults", "default", "grpo", "two-node placement", "actor over two nodes"])
def test_every_role_pod_requests_cpu_and_memory(tmp_path, case):
    """A pod with no request is BestEffort, the first one a node under memory pressure evicts. The
    chart's defaults alone, and with `helm-values` of a config whose model is not readable here."""
    raw = {"chart defaults": default_config(), "default": default_config(),
           "grpo": default_config() | {"algorithm": "grpo"}, "two-node placement": two_node_config(),
           "actor over two nodes": spanning_actor()}[case]
    config = write(tmp_path / "run.yaml", raw)
    values = write(tmp_path / "values.yaml", render_values(parse_config(raw)))
    docs = render() if case == "chart defaults" else render("--set-file", f"config={config}", "-f", str(values),
                                                            *MODEL_VOLUME)
    requests = role_requests(docs)
    assert set(requests) == set(parse_config(raw).roles())
    for role, asked in requests.items():
        assert {"cpu", "memory"} <= set(asked), (case, role, asked)
    if case == "actor over two nodes":
        assert find(docs, "StatefulSet", f"{PREFIX}-actor")


def test_a_role_request_set_by_hand_keeps_the_other_defaults():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    requests = role_requests(render("--set", "actor.resources.requests.cpu=2"))
    assert requests["actor"] == {"cpu": 2, "memory": defaults["actor"]["resources"]["requests"]["memory"]}
    assert requests["critic"] == defaults["critic"]["resources"]["requests"]


@pytest.fixture
def qwen_ppo(tmp_path, monkeypatch) -> tuple[dict, dict, list[dict]]:
    """The default run on a model of Qwen2-1.5B's dimensions in ./models, as helm-values reads it and
    the model volume holds it: (its config, values_for, the render)."""
    monkeypatch.chdir(tmp_path)
    model_dir(tmp_path / "models" / "qwen", QWEN2_1_5B)
    raw = default_config()
    raw["model"] = {"model_name_or_path": "models/qwen"}
    values = values_for(parse_config(raw))
    docs = render("--set-file", f"config={write(tmp_path / 'run.yaml', raw)}",
                  "-f", str(write(tmp_path / "values.yaml", render_values(parse_config(raw)))), *MODEL_VOLUME)
    return raw, values, docs


def test_helm_values_requests_reach_the_pods(qwen_ppo):
    raw, values, docs = qwen_ppo
    for role in parse_config(raw).roles():
        asked = container(docs, role)["resources"]["requests"]
        assert asked == values[role]["resources"]["requests"], role
        assert asked["memory"].endswith("Gi")  # the planner knew the model
    assert "limits" not in container(docs, "coordinator")["resources"]  # no memory limit to be killed at


def test_helm_values_size_the_runs_volume_and_the_default_holds_a_1_5b_ppo_run(qwen_ppo):
    raw, values, docs = qwen_ppo
    persistence = values["persistence"]
    claim = find(docs, "PersistentVolumeClaim", f"{PREFIX}-runs")
    assert claim["spec"]["resources"]["requests"]["storage"] == persistence["size"]
    need = (CheckpointSection().keep + 1) * int(persistence["checkpointSize"].removesuffix("Gi"))
    assert int(persistence["size"].removesuffix("Gi")) >= need
    default = yaml.safe_load((CHART / "values.yaml").read_text())["persistence"]["size"]
    assert int(default.removesuffix("Gi")) >= need, f"the default {default} holds no 1.5B PPO run ({need}Gi)"
    render("--set", f"persistence.checkpointSize={persistence['checkpointSize']}")  # the default size passes


def test_a_runs_volume_too_small_for_the_checkpoints_is_refused_naming_why():
    keep = CheckpointSection().keep  # the chart's default of checkpoint.keep, for a config without one
    assert "keep" not in default_config().get("checkpoint", {})
    message = failure("--set", "persistence.checkpointSize=60Gi", "--set", "persistence.size=200Gi")
    assert (f"persistence.size is 200Gi, but the run's checkpoints need {60 * (keep + 1)}Gi: checkpoint.keep ({keep}) "
            "complete ones plus the one being written, each persistence.checkpointSize (60Gi") in message


@pytest.mark.parametrize(("size", "fits"), [("239Gi", False), ("240Gi", True), ("257G", False), ("258G", True),
                                            ("2Ti", True), ("0.2Ti", False), ("257698037760", True)])
def test_the_size_check_reads_kubernetes_quantities(size, fits):
    args = ("--set", "persistence.checkpointSize=60Gi", "--set", f"persistence.size={size}")  # needs 240Gi
    if fits:
        find(render(*args), "PersistentVolumeClaim", f"{PREFIX}-runs")
    else:
        assert "but the run's checkpoints need 240Gi" in failure(*args)


def test_the_check_follows_the_configs_checkpoint_keep(tmp_path):
    raw = default_config() | {"checkpoint": {"keep": 1}}
    config = write(tmp_path / "run.yaml", raw)
    render("--set-file", f"config={config}", "--set", "persistence.checkpointSize=100Gi")  # 2 x 100Gi fit 200Gi
    message = failure("--set-file", f"config={config}", "--set", "persistence.checkpointSize=101Gi")
    assert "need 202Gi: checkpoint.keep (1)" in message


def test_no_check_without_a_checkpoint_size_or_for_a_claim_the_chart_does_not_create():
    render("--set", "persistence.size=1Gi")
    docs = render("--set", "persistence.existingClaim=runs", "--set", "persistence.checkpointSize=60Gi")
    assert ("PersistentVolumeClaim", f"{PREFIX}-runs") not in {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_notes_say_what_the_checkpoints_take_of_an_existing_claim():
    text = notes("--set", "persistence.existingClaim=runs", "--set", "persistence.checkpointSize=60Gi")
    assert "Checkpoints take up to 240Gi there" in text and "the claim runs must have that much free" in text
    assert "Checkpoints take" not in notes()


def test_a_size_that_is_no_quantity_is_refused_naming_the_value():
    assert "/persistence/checkpointSize" in failure("--set", "persistence.checkpointSize=lots")
    assert "/persistence/size" in failure("--set", "persistence.size=1.5.5Gi")
    # Past the schema, the chart's own reading of the quantity refuses it the same way.
    assert 'persistence.size: "1.5.5Gi" is not a size as Kubernetes writes one' in failure(
        "--set", "persistence.size=1.5.5Gi", "--set", "persistence.checkpointSize=1Gi", "--skip-schema-validation")


def test_every_role_has_requests_in_values_yaml():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in GRPC_PORTS:
        assert {"cpu", "memory"} <= set(values[role]["resources"]["requests"]), role


def test_the_documented_helm_values_are_what_it_writes(tmp_path):
    """docs/deploy-kubernetes.md's `placement.yaml` for its devices map and a 1.5B model."""
    text = DOC.read_text().split("For the map above and a model of Qwen2-1.5B's dimensions", 1)[1]
    documented = yaml.safe_load(text.split("```yaml", 1)[1].split("```", 1)[0])
    raw = default_config()
    raw["model"] = {"model_name_or_path": model_dir(tmp_path / "model", QWEN2_1_5B)}
    raw["devices"] = {"actor": [f"node0:{i}" for i in range(4)], "rollout": ["node0:0", "node0:1"],
                      "reward": ["node1:0", "node1:1"], "critic": ["node1:2", "node1:3"]}
    assert documented == values_for(parse_config(raw))

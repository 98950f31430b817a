"""The chart's PrometheusRule and Grafana dashboard ConfigMap for kube-prometheus-stack: they carry
exactly deploy/prometheus/alerts.yml and deploy/grafana/dashboards/*.json, through the chart's
copies (Helm reads no file outside the chart), which must stay identical to those sources."""

from __future__ import annotations

import json
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_helm import CHART, KUBE_VERSIONS, PREFIX, find, render
from tests.deploy.tools import REPO, tool

pytestmark = pytest.mark.procs

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARDS = REPO / "deploy" / "grafana" / "dashboards"
FILES = CHART / "files"
SYNC = ("cp deploy/prometheus/alerts.yml deploy/helm/rolefleet/files/alerts.yml && rm -rf "
        "deploy/helm/rolefleet/files/dashboards && cp -r deploy/grafana/dashboards deploy/helm/rolefleet/files/")


def test_the_charts_copies_are_the_sources_byte_for_byte():
    sources = {"alerts.yml": ALERTS.read_bytes(), **{f"dashboards/{p.name}": p.read_bytes()
                                                      for p in DASHBOARDS.glob("*.json")}}
    copies = {str(p.relative_to(FILES)): p.read_bytes() for p in FILES.rglob("*") if p.is_file()}
    stale = sorted(name for name in sources.keys() | copies.keys() if sources.get(name) != copies.get(name))
    assert not stale, f"the chart's copies differ from their sources: {stale}; sync them with `{SYNC}`"


def test_no_prometheus_rule_or_dashboards_unless_enabled():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render()}
    assert ("PrometheusRule", PREFIX) not in kinds and ("ConfigMap", f"{PREFIX}-dashboards") not in kinds


@pytest.fixture(scope="module")
def rule() -> dict:
    docs = render("--set", "monitoring.prometheusRule.enabled=true",
                  "--set", "monitoring.prometheusRule.labels.release=kube-prometheus-stack")
    return find(docs, "PrometheusRule", PREFIX)


def test_the_prometheus_rule_carries_the_groups_of_alerts_yml(rule):
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # what the stack's Prometheus selects
    assert rule["spec"] == {"groups": yaml.safe_load(ALERTS.read_text())["groups"]}


def test_promtool_accepts_the_rendered_rules(rule, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run([tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    count = sum(len(g["rules"]) for g in yaml.safe_load(ALERTS.read_text())["groups"])
    assert f"SUCCESS: {count} rules found" in done.stdout


def dashboards(*args: str) -> dict:
    return find(render("--set", "monitoring.dashboards.enabled=true", *args), "ConfigMap", f"{PREFIX}-dashboards")


def test_the_dashboards_configmap_holds_every_dashboard_for_the_grafana_sidecar():
    configmap = dashboards()
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's default
    sources = {p.name: json.loads(p.read_text()) for p in DASHBOARDS.glob("*.json")}
    assert sources and set(configmap["data"]) == set(sources)
    for name, text in configmap["data"].items():
        assert json.loads(text) == sources[name], name
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(configmap, version, strict=True)


def test_the_sidecar_label_namespace_and_annotations_are_configurable():
    configmap = dashboards("--set", "monitoring.dashboards.label=dashboards", "--set-string",
                           "monitoring.dashboards.labelValue=rolefleet", "--set", "monitoring.dashboards.namespace=monitoring",
                           "--set", "monitoring.dashboards.annotations.grafana_folder=RoleFleet")
    assert configmap["metadata"]["labels"]["dashboards"] == "rolefleet"
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "RoleFleet"}

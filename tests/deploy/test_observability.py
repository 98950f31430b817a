"""The Prometheus config, alert rules and Grafana dashboard under deploy/, checked with the real tools:
promtool validates the config and rules and runs the alert unit tests, every dashboard query parses,
and a real Prometheus scrapes a real role server through the shipped scrape config."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from rolefleet.common import metrics
from tests.deploy.tools import REPO, tool
from tests.e2e.procs import rolefleet, terminate, wait_ready

pytestmark = pytest.mark.procs

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "rolefleet.json"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
ROLES = ("coordinator", "actor", "reward", "critic", "teacher")
# The compose service names and metrics ports the shipped scrape config targets.
COMPOSE_TARGETS = {"coordinator": "coordinator:9100", "actor": "actor:9101", "reward": "reward:9102",
                   "critic": "critic:9103", "teacher": "teacher:9104"}
# What Grafana puts in place of its built-in variables; any interval parses the same.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1m"}
E2E_TIMEOUT_S = 30


def promtool(*args: str) -> str:
    result = subprocess.run([tool("promtool"), *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True,
                            timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title and refId, PromQL expression) of every panel query."""
    return [(f"{panel['title']} {target['refId']}", target["expr"])
            for panel in panels(board) for target in panel.get("targets", [])]


def concrete(expr: str, variables: set[str]) -> str:
    """`expr` with Grafana's variables replaced by values Prometheus accepts; a variable the dashboard
    does not define fails the test (Grafana would leave it in the query as is)."""
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in variables, f"{expr!r} uses ${name}, which the dashboard does not define"
        return ".*"  # what "All" stands for in every variable of this dashboard

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def concrete_queries(board: dict) -> list[tuple[str, str]]:
    variables = {v["name"] for v in board["templating"]["list"]}
    return [(where, concrete(expr, variables)) for where, expr in queries(board)]


def exported_series() -> set[str]:
    """The series names the roles can export, as prometheus_client writes them."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    names = set()
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


# --- Prometheus -------------------------------------------------------------------------------------

def test_the_prometheus_config_and_its_rule_files_are_valid():
    assert "SUCCESS: 1 rule files found" in promtool("check", "config", "prometheus.yml")


def test_the_scrape_config_targets_every_role_by_its_compose_service():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    # The roles' own `role` label must survive the scrape under its name (not `exported_role`).
    assert job["honor_labels"] is True
    targets = {group["labels"]["role"]: group["targets"] for group in job["static_configs"]}
    assert targets == {role: [target] for role, target in COMPOSE_TARGETS.items()}
    interval = int(config["global"]["scrape_interval"].rstrip("s"))
    assert 5 <= interval <= 15


def test_the_alert_rules_are_valid_and_say_how_bad_and_what():
    assert "SUCCESS: 8 rules found" in promtool("check", "rules", "alerts.yml")
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"].keys() >= {"summary", "description"}, rule["alert"]


def test_the_alert_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_every_alert_is_tested_firing_and_quiet():
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for name in (rule["alert"] for rule in alert_rules()):
        outcomes = {bool(case["exp_alerts"]) for case in cases if case["alertname"] == name}
        assert outcomes == {True, False}, f"{name}: tested firing and quiet? {outcomes}"


# --- Grafana ----------------------------------------------------------------------------------------

def test_every_dashboard_query_parses(tmp_path):
    # promtool parses PromQL only inside rules: each query becomes a recording rule.
    found = concrete_queries(dashboard())
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(found)]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", str(path))


def test_the_dashboard_is_well_formed():
    board = dashboard()
    assert board["uid"] == "rolefleet" and board["title"] and isinstance(board["schemaVersion"], int)
    every = panels(board)
    ids = [panel["id"] for panel in every]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    cells = set()
    for panel in every:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
    names = [v["name"] for v in board["templating"]["list"]]
    assert {"role", "group"} <= set(names)


def test_every_dashboard_data_source_is_the_provisioned_prometheus():
    def walk(node):
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    sources = list(walk(dashboard()))
    assert sources and all(source == {"type": "prometheus", "uid": "prometheus"} for source in sources), sources


def test_the_provisioning_finds_the_data_source_and_the_dashboard():
    (source,) = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert (source["uid"], source["type"], source["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
    (provider,) = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "rolefleet.yml").read_text())[
        "providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"


# --- both against the code and the docs -------------------------------------------------------------

def test_rules_and_dashboard_use_only_metrics_the_roles_export():
    exported = exported_series()
    texts = [rule["expr"] for rule in alert_rules()] + [expr for _, expr in queries(dashboard())]
    used = {name for text in texts for name in re.findall(r"\brolefleet_\w+", text)}
    assert used - exported == set(), f"not exported by rolefleet.common.metrics: {sorted(used - exported)}"
    # The alerts and dashboard cover the GPU gauges and the headline metrics.
    for name in ("rolefleet_gpu_utilization_ratio", "rolefleet_gpu_memory_used_bytes",
                 "rolefleet_gpu_memory_total_bytes", "rolefleet_gpu_memory_fragmentation_ratio",
                 "rolefleet_rollout_latency_seconds_bucket", "rolefleet_tokens_generated_total",
                 "rolefleet_health", "rolefleet_train_steps_total"):
        assert name in used, name


def test_the_operations_doc_covers_every_alert_and_panel():
    doc = OPERATIONS_DOC.read_text()
    missing = [rule["alert"] for rule in alert_rules() if f"`{rule['alert']}`" not in doc]
    missing += [panel["title"] for panel in panels(dashboard()) if panel["type"] != "row"
                and f"**{panel['title']}**" not in doc]
    assert not missing, f"not in docs/operations.md: {missing}"


# --- a real Prometheus scraping a real role --------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Loopback only, and never through a proxy from the environment.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with _LOCAL.open(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def poll(what: str, check, deadline: float, proc: subprocess.Popen, log: Path):
    """`check()`'s first truthy result before `deadline`, retrying through connection errors (Prometheus
    still starting); a Prometheus that exited, or the deadline, fails the test with its log."""
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}:\n{log.read_text()}"
        try:
            if result := check():
                return result
        except OSError as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"no {what} within {E2E_TIMEOUT_S}s (last error: {last}):\n{log.read_text()[-3000:]}")


def scrape_config_for(reward_metrics_port: int, tmp_path: Path) -> Path:
    """The shipped prometheus.yml on loopback: the reward target points at the real role, the other
    roles at ports where nothing listens (they are not running); scrapes and rules every second."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / "alerts.yml")]
    for group in config["scrape_configs"][0]["static_configs"]:
        port = reward_metrics_port if group["labels"]["role"] == "reward" else free_port()
        group["targets"] = [f"127.0.0.1:{port}"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_prometheus_scrapes_a_real_role_with_the_shipped_config_and_rules(tmp_path):
    # The reward role loads no model: the path is required by the config but never read.
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": "observability", "output_dir": str(tmp_path / "out")},
                                      "model": {"model_name_or_path": str(tmp_path / "no-model")}}))
    ready = tmp_path / "reward.json"
    prom_log = tmp_path / "prometheus.log"
    role = rolefleet("serve", "reward", "--config", str(config), "--ready-file", str(ready))
    prometheus = None
    try:
        metrics_port = wait_ready(role, ready)["metrics_port"]
        port = free_port()
        with prom_log.open("w") as log:
            prometheus = subprocess.Popen(
                [tool("prometheus"), f"--config.file={scrape_config_for(metrics_port, tmp_path)}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + E2E_TIMEOUT_S

        def reward_healthy():
            return [s for s in api(port, "query", query="rolefleet_health")["result"]
                    if s["metric"].get("role") == "reward" and s["value"][1] == "1"]

        (series,) = poll("rolefleet_health{role=\"reward\"} == 1", reward_healthy, deadline, prometheus, prom_log)
        # The role's own label kept its name, and the job is the shipped one.
        assert series["metric"] == {"__name__": "rolefleet_health", "role": "reward", "job": "rolefleet",
                                    "instance": f"127.0.0.1:{metrics_port}"}

        # The roles that are not running cost only their own `up` series. (The reward's last scrape
        # may have passed its 1 s timeout on a loaded machine: its `up` is read until it is 1.)
        def every_target_scraped():
            up = {s["metric"]["role"]: s["value"][1] for s in api(port, "query", query="up")["result"]}
            return up if up.keys() == set(ROLES) and up["reward"] == "1" else None

        assert poll("an up series per role", every_target_scraped, deadline, prometheus, prom_log) == {
            "coordinator": "0", "actor": "0", "reward": "1", "critic": "0", "teacher": "0"}

        # Every alert rule evaluates without error on real series, and RoleDown picks out the roles
        # that are down, except a critic or teacher that never answered (a run without one).
        def rules_evaluated():
            rules = [r for g in api(port, "rules")["groups"] for r in g["rules"]]
            return rules if all(r["health"] != "unknown" for r in rules) else None

        rules = poll("evaluated rules", rules_evaluated, deadline, prometheus, prom_log)
        assert len(rules) == len(alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

        def role_down():
            down = {a["labels"]["role"] for a in api(port, "alerts")["alerts"] if a["labels"]["alertname"] == "RoleDown"}
            return down if down == {"coordinator", "actor"} else None

        poll("RoleDown pending for coordinator and actor", role_down, deadline, prometheus, prom_log)

        # The dashboard's queries run on the live server too.
        for where, expr in concrete_queries(dashboard()):
            try:
                api(port, "query", query=expr)
            except urllib.error.HTTPError as exc:
                raise AssertionError(f"{where}: {expr}: {exc.read().decode()}") from None
    finally:
        if prometheus is not None:
            prometheus.send_signal(signal.SIGTERM)
            try:
                prometheus.wait(timeout=15)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait()
        terminate(role)

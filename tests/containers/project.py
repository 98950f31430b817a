"""A compose project of the container tier: a directory laid out as a user's (configs/, models/,
deploy/ beside a docker-compose.yml that `rolefleet deploy compose` wrote), driven with the real
Docker Compose CLI under a project name of its own, so that it touches nothing it did not create
and `down` can prove that nothing of it is left."""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.deploy.tools import tool

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
ROLEFLEET_IMAGE = f"rolefleet:{VERSION}-cpu"
PROMETHEUS_IMAGE = "rolefleet-prometheus:debian"
ROLES = ("actor", "reward", "critic", "coordinator")


def docker(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}: {result.stderr.decode()[-2000:]}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    """`check()`'s first truthy answer, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Project:
    """One compose project in `root`, named `name` (containers, volumes and network carry it)."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = root, name
        self.token = secrets.token_urlsafe(24)
        self.ports = {var: free_port() for var in
                      ("ROLEFLEET_HTTP_PORT", "ROLEFLEET_GRPC_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT")}
        root.mkdir(parents=True, exist_ok=True)
        for part in ("prometheus", "grafana"):  # the files the monitoring services mount
            shutil.copytree(REPO / "deploy" / part, root / "deploy" / part)
        (root / "configs").mkdir()
        (root / "models").mkdir()

    # --- as a user sets one up -----------------------------------------------------------------

    def add_model(self, source: Path, name: str) -> str:
        shutil.copytree(source, self.root / "models" / name)
        return f"models/{name}"

    def generate(self, config: str, *overrides: str) -> dict:
        """`rolefleet deploy compose CONFIG OVERRIDES > docker-compose.yml` in the project directory,
        and the .env beside it: the token, the CPU images, free host ports."""
        rolefleet = str(Path(sys.executable).parent / "rolefleet")
        done = subprocess.run([rolefleet, "deploy", "compose", config, *overrides], cwd=self.root,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        (self.root / "docker-compose.yml").write_text(done.stdout)
        env = {"ROLEFLEET_TOKEN": self.token, "ROLEFLEET_IMAGE": ROLEFLEET_IMAGE, "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
               **{k: str(v) for k, v in self.ports.items()}}
        (self.root / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        return json.loads(self.compose("config", "--format", "json").stdout)

    # --- compose ---------------------------------------------------------------------------------

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        # The environment of the test process does not leak into the project: .env alone sets it.
        env = {k: v for k, v in os.environ.items() if k not in ("ROLEFLEET_TOKEN", "ROLEFLEET_IMAGE")}
        result = subprocess.run([tool("docker-compose"), "-p", self.name, *args], cwd=self.root, env=env,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def up(self, *services: str) -> None:
        """`up -d` of `services` (every role, and Prometheus; Grafana has no image here)."""
        self.compose("up", "-d", "--no-build", *services, timeout=600)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: {ids}"
        return ids[0]

    def state(self, service: str) -> dict:
        inspected = json.loads(docker("inspect", self.container(service)).stdout)[0]
        return {**inspected["State"], "RestartCount": inspected["RestartCount"]}

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service).stdout

    def exit_code(self, service: str, timeout: float) -> int:
        """`service`'s exit code once it has exited (the coordinator, when the run ends)."""
        state = wait_for(f"{service} to exit", lambda: (s := self.state(service))["Status"] == "exited" and s,
                         timeout, every=2)
        return state["ExitCode"]

    # --- the run's files, in the runs volume -------------------------------------------------------

    def run_file(self, path: str) -> bytes:
        """A file of the runs volume, read through a container of the image (whatever is running)."""
        return docker("run", "--rm", "-v", f"{self.name}_runs:/runs:ro", "--entrypoint", "cat", ROLEFLEET_IMAGE,
                      f"/runs/{path}").stdout

    def copy_run(self, run: str, dest: Path) -> Path:
        """The run's directory of the runs volume, copied to `dest/run`."""
        tar = docker("run", "--rm", "-v", f"{self.name}_runs:/runs:ro", "--entrypoint", "tar", ROLEFLEET_IMAGE,
                     "-C", "/runs", "-c", run).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(dest, filter="data")
        return dest / run

    def metrics(self, run: str) -> list[dict]:
        return [json.loads(line) for line in self.run_file(f"{run}/metrics.jsonl").decode().splitlines() if line]

    def last_step(self, run: str) -> int:
        """The newest step of metrics.jsonl, read in the running coordinator (0 before the first)."""
        done = self.compose("exec", "-T", "coordinator", "sh", "-c", f"tail -n 1 /runs/{run}/metrics.jsonl", check=False)
        try:
            return json.loads(done.stdout)["step"] if done.returncode == 0 and done.stdout.strip() else 0
        except ValueError:
            return 0  # a line being written

    # --- the published ports -------------------------------------------------------------------------

    def http(self, path: str, token: str | None = None) -> tuple[int, dict]:
        url = f"http://127.0.0.1:{self.ports['ROLEFLEET_HTTP_PORT']}{path}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def prometheus(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    # --- down ----------------------------------------------------------------------------------------

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        found = []
        for kind, args in (("container", ["ps", "-a", "-q"]), ("volume", ["volume", "ls", "-q"]),
                           ("network", ["network", "ls", "-q"])):
            found += [f"{kind} {i}" for i in docker(*args, "--filter", label).stdout.decode().split()]
        return found

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300, check=False)

"""`rolefleet up`: start every role of a config as its own process on this machine, run, stop all.

Each role gets CUDA_VISIBLE_DEVICES from its device group (empty: CPU; `devices: auto` is chosen
before, `app/placement.py`), a ready file through which it reports the ports it bound, so configs
may use port 0 and runs never collide, and a progress file (`common/progress.py`) whose latest stage
`up` shows while the role starts, within its start-up limit (`app/startup.py`). Children die
with the supervisor (PR_SET_PDEATHSIG), so an interrupted `up` leaves no process behind.
Restart-with-backoff of crashed roles belongs to the fault-tolerance work; today a crashed role
stops the run with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

from rolefleet.app.placement import placed
from rolefleet.app.snapshot_budget import fitting_snapshots
from rolefleet.app.startup import StartupLimit, startup_limit
from rolefleet.common import progress
from rolefleet.common.config import ConfigError, RoleFleetConfig, dial_host, dump_config
from rolefleet.common.errors import RoleFleetError
from rolefleet.rpc.auth import write_run_token
from rolefleet.rpc.roles import fetch_status
from rolefleet.rpc.run_files import RUN_TOKEN_FILE
from rolefleet.rpc.server import StartupError
from rolefleet.serve import run_security
from rolefleet.trainer.nodes import layout_for
from rolefleet.trainer.workers import free_port

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0  # how often `up` shows what the roles still starting are doing
STATUS_TIMEOUT_S = 30.0
STOP_GRACE_S = 20.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)


RESTART_BACKOFF_S = 1.0


def _killed(code: int) -> bool:
    """Ended by a signal other than the stop signals (kill -9, the OOM killer, a segfault)."""
    return code < 0 and -code not in (signal.SIGTERM, signal.SIGINT)


class RoleFailed(RuntimeError):
    """A role process could not be brought up."""


@dataclass
class RoleProcess:
    role: str
    proc: subprocess.Popen  # the role's server (node 0 of a group over several nodes)
    ready_file: Path
    log_file: Optional[IO]
    nodes: list[subprocess.Popen] = field(default_factory=list)  # node 1, 2 ... of a group over several
    node_logs: list[IO] = field(default_factory=list)
    progress_file: Optional[Path] = None  # where its processes report their start-up stages
    started: float = field(default_factory=time.monotonic)

    def poll(self) -> Optional[int]:
        """None while every process of the role runs; else the code of one that ended (the server's
        first): the role is one unit, whichever of its processes ends."""
        code = self.proc.poll()
        if code is not None:
            return code
        return next((c for c in (p.poll() for p in self.nodes) if c is not None), None)

    def ended_part(self) -> str:
        """Which process of the role ended: `actor`, or `actor node 1`."""
        if self.proc.poll() is None:
            for k, p in enumerate(self.nodes, start=1):
                if p.poll() is not None:
                    return f"{self.role} node {k}"
        return self.role

    def close_logs(self) -> None:
        for f in [self.log_file, *self.node_logs]:
            if f is not None:
                f.close()

    def ports(self) -> Optional[dict]:
        try:
            return json.loads(self.ready_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


def _end_what_is_left(rp: RoleProcess) -> None:
    """After a role's process has ended: kill whatever is left of its process groups (the sessions
    `start` gave it and its node processes). A role killed by a signal cannot stop its descendants:
    worker ranks and a vLLM engine's processes would go on holding GPU memory and ports that the
    restarted role needs; a node process whose server ended would wait for a group that is gone."""
    for proc in (rp.proc, *rp.nodes):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nothing left
            pass


def role_env(cfg: RoleFleetConfig, role: str, node: int = 0) -> dict[str, str]:
    """The parent's environment (NCCL_*, proxies, HF_* pass through), with the GPUs of `role`'s
    process on `node` (its server: node 0)."""
    env = dict(os.environ)
    by_node = cfg.devices.by_node(role) if role != "coordinator" else []
    gpus = by_node[node][1] if node < len(by_node) else []
    # Empty means no GPU at all (CPU roles, and the coordinator, which never holds one).
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class Supervisor:
    def __init__(self, cfg: RoleFleetConfig, config_path: Path, workdir: Path):
        self.cfg = cfg
        self.config_path = config_path
        self.workdir = workdir
        self.logs = cfg.run.out / "logs"
        self.procs: dict[str, RoleProcess] = {}
        self.overrides: dict[str, list[str]] = {}
        self.restarts: dict[str, int] = {}

    def start(self, role: str, overrides: list[str], log_to_file: bool) -> RoleProcess:
        """Start `role`; servers log to runs/<name>/logs/<role>.log, the coordinator to the console.
        A role whose workers span nodes also gets a process per other node (`serve ROLE --node-rank
        K`, logging to <role>.node<K>.log), all meeting on loopback at a port free now."""
        ready = self.workdir / f"{role}.ready.json"
        ready.unlink(missing_ok=True)  # a restart: the dead process's ports are not this one's readiness
        progress_file = self.workdir / f"{role}.progress.jsonl"
        progress_file.unlink(missing_ok=True)
        self.overrides[role] = overrides
        layout = layout_for(role, self.cfg)
        if layout.spans:
            overrides = [*overrides, f"{role}.rendezvous.host=127.0.0.1", f"{role}.rendezvous.port={free_port()}"]
        mode = "a" if role in self.procs else "w"
        log_file = open(self.logs / f"{role}.log", mode) if log_to_file else None
        level = "info" if log_to_file else logging.getLevelName(logging.getLogger().level).lower()
        proc = self._spawn(role, 0, [*overrides, "--ready-file", str(ready)], level, log_file, progress_file)
        rp = RoleProcess(role, proc, ready, log_file, progress_file=progress_file)
        for node in range(1, layout.nodes):
            rp.node_logs.append(open(self.logs / f"{role}.node{node}.log", mode))
            # Its own metrics port: the server's (kept over restarts) is taken on this one machine.
            args = [*overrides, f"{role}.metrics_port=0", "--node-rank", str(node)]
            rp.nodes.append(self._spawn(role, node, args, level, rp.node_logs[-1], progress_file))
        self.procs[role] = rp
        log.info("started %s (pid %d%s)", role, proc.pid, "".join(f", node {k} pid {p.pid}"
                                                                  for k, p in enumerate(rp.nodes, start=1)))
        return rp

    def _spawn(self, role: str, node: int, args: list[str], level: str, log_file: Optional[IO],
               progress_file: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "rolefleet.cli", "--log-level", level, "serve", role, *args,
               "--config", str(self.config_path)]
        env = role_env(self.cfg, role, node) | {progress.PROGRESS_FILE_ENV: str(progress_file)}
        # A session of its own: a Ctrl-C in the terminal reaches `up` alone, which stops the
        # children in order (coordinator first) instead of all at once.
        return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=log_file,
                                start_new_session=True, preexec_fn=functools.partial(_die_with_parent, os.getpid()))

    def wait_ready(self, roles: list[str]) -> dict[str, dict]:
        """The ports of `roles` once each has written its ready file. Every PROGRESS_EVERY_S the
        latest stage of each role still starting is shown; a role past its start-up limit
        (`run.startup_timeout_s`) or one that exits fails the run."""
        limits = {role: startup_limit(self.cfg, role) for role in roles}
        ports: dict[str, dict] = {}
        shown = time.monotonic()
        while len(ports) < len(roles):
            for role in roles:
                rp = self.procs[role]
                if (code := rp.poll()) is not None:
                    part = rp.ended_part()
                    name = role if part == role else f"{role}.node{part.rpartition(' ')[2]}"
                    raise RoleFailed(f"{part} exited with code {code} before it was ready; "
                                     f"the end of {self.logs / (name + '.log')}:\n{self.log_tail(name)}")
                if role not in ports and (p := rp.ports()) is not None:
                    ports[role] = p
                elif role not in ports and time.monotonic() - rp.started > limits[role].seconds:
                    raise RoleFailed(self.too_slow(role, limits[role]))
            starting = [role for role in roles if role not in ports]
            if starting and time.monotonic() - shown >= PROGRESS_EVERY_S:
                for role in starting:
                    print(f"rolefleet: {self.starting(role)}", flush=True)
                shown = time.monotonic()
            time.sleep(0.1)
        return ports

    def starting(self, role: str) -> str:
        """"actor: loading weights (3 of 8), 42 s": the role's latest stage and its time so far."""
        rp = self.procs[role]
        stage = progress.describe(progress.latest(rp.progress_file) if rp.progress_file else None)
        return f"{role}: {stage}, {time.monotonic() - rp.started:.0f} s"

    def too_slow(self, role: str, limit: StartupLimit) -> str:
        return (f"{self.starting(role)}: not ready within {limit.seconds:.0f} s ({limit.why}); if it is still "
                f"making progress, give it longer with run.startup_timeout_s=SECONDS. The end of "
                f"{self.logs / (role + '.log')}:\n{self.log_tail(role)}")

    def check_identity(self, addresses: dict[str, str], ports: dict[str, dict]) -> None:
        """Each address must be answered by the process this run started, not a server left over
        from another run that happens to answer there: the run would train that one instead."""
        for role, address in addresses.items():
            try:
                status = asyncio.run(fetch_status(role, address, STATUS_TIMEOUT_S))
            except RoleFleetError as exc:
                raise RoleFailed(f"{role} at {address} does not answer GetStatus: {exc}") from None
            if status.instance_id != ports[role].get("instance_id"):
                raise RoleFailed(f"{role} at {address} is another server (instance {status.instance_id or '?'}), "
                                 f"not the {role} this run started (pid {ports[role].get('pid')}); stop the "
                                 "other server or change the port")

    def log_tail(self, role: str, lines: int = 8) -> str:
        try:
            return "\n".join((self.logs / f"{role}.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def watch(self, main: str) -> int:
        """Wait for `main` (the coordinator) to end the run. A role that dies meanwhile is started
        again on its ports, with backoff, up to `run.max_restarts` times (the coordinator recovers
        the run from its newest checkpoint); so is a coordinator killed by a signal (it resumes).
        A coordinator that exits by itself ended the run: its code is the run's."""
        while True:
            for role, rp in list(self.procs.items()):
                code = rp.poll()
                if code is None:
                    continue
                if role == main and not _killed(code):
                    return code
                if self.restarts.get(role, 0) >= self.cfg.run.max_restarts:
                    print(f"rolefleet: {rp.ended_part()} exited with code {code} during the run and was restarted "
                          f"{self.restarts.get(role, 0)} times (run.max_restarts); stopping. The end of its log:\n"
                          f"{self.log_tail(role)}", file=sys.stderr, flush=True)
                    return code if role == main else 1
                self.restart(role, code)
            time.sleep(0.2)

    def restart(self, role: str, code: int) -> None:
        n = self.restarts[role] = self.restarts.get(role, 0) + 1
        backoff = min(RESTART_BACKOFF_S * 2 ** (n - 1), 30.0)
        old = self.procs[role]
        whole = f" (every process of {role}: its group forms anew)" if old.nodes else ""
        print(f"rolefleet: {old.ended_part()} exited with code {code} during the run; restarting it in "
              f"{backoff:.0f} s{whole} ({n} of {self.cfg.run.max_restarts})", file=sys.stderr, flush=True)
        _end_what_is_left(old)
        time.sleep(backoff)
        old.close_logs()
        ports = old.ports() or {}
        same_ports = [f"{role}.{key}={ports[name]}" for key, name in
                      (("port", "grpc_port"), ("metrics_port", "metrics_port"), ("http_port", "http_port"),
                       ("endpoint.port", "endpoint_port"))
                      if name in ports]
        resume = ["run.resume=true"] if role == "coordinator" else []
        self.start(role, [*self.overrides[role], *same_ports, *resume], log_to_file=old.log_file is not None)
        if role != "coordinator":
            self.wait_ready([role])

    def stop_all(self) -> None:
        """The coordinator first, so it can finish its step while the roles still answer; then the
        roles. SIGTERM (each shuts down in order), then SIGKILL after the grace period."""
        first = [rp for rp in self.procs.values() if rp.role == "coordinator"]
        rest = [rp for rp in self.procs.values() if rp.role != "coordinator"]
        for group in (first, rest):
            for rp in group:
                if rp.proc.poll() is None:
                    rp.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for rp in group:
                # The server first: stopping its group stops the other nodes' ranks, and their node
                # processes then exit by themselves (SIGTERM only if they do not).
                for proc in (rp.proc, *rp.nodes):
                    _stop(rp.role, proc, deadline, signal_first=proc is not rp.proc)
                _end_what_is_left(rp)
                rp.close_logs()


def _stop(role: str, proc: subprocess.Popen, deadline: float, signal_first: bool) -> None:
    """Wait for `proc` until `deadline` (after a SIGTERM at half the time left, for a node process
    that has not stopped by itself), then kill it."""
    waits = [max(0.1, (deadline - time.monotonic()) / 2)] if signal_first else []
    for wait in waits:
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0fs; killing it", role, STOP_GRACE_S)
        proc.kill()
        proc.wait()


def with_run_token(cfg: RoleFleetConfig) -> tuple[RoleFleetConfig, Optional[Path]]:
    """The config with the run's token: the one it names, else a new one in <run.out>/token that every
    role started here reads (security.token_file), so no other local user's process (nor, on a
    role bound beyond loopback, any other machine's) can call the roles. Open only when the config
    says so (security.allow_unauthenticated). Also returns the file made, if one was."""
    s = cfg.security
    if s.allow_unauthenticated or s.token_file or (s.token_env and os.environ.get(s.token_env)):
        return cfg, None
    path = write_run_token(cfg.run.out / RUN_TOKEN_FILE)
    return cfg.model_copy(update={"security": s.model_copy(update={"token_file": str(path)})}), path


def endpoint_url(cfg: RoleFleetConfig, port: int) -> str:
    """The base URL of the actor's endpoint as this machine dials it."""
    scheme = "https" if cfg.security.tls.enabled else "http"
    return f"{scheme}://{dial_host(cfg.actor.endpoint.host)}:{port}"


def up(cfg: RoleFleetConfig) -> int:
    """Run the whole cluster locally. Returns the coordinator's exit code."""
    # `rolefleet up` has chosen the devices already; a caller of its own not.
    cfg, made_token = with_run_token(fitting_snapshots(placed(cfg)))
    try:
        run_security(cfg, "client")  # `up`'s own calls (the identity check) present the run's token and certificate
    except StartupError as exc:
        raise ConfigError(str(exc)) from None
    out = cfg.run.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    # Every role reads the same resolved config, devices: auto as the map chosen (restarts, `serve`).
    config_path.write_text(dump_config(cfg))
    servers = [r for r in cfg.roles() if r != "coordinator"]
    with tempfile.TemporaryDirectory(prefix="rolefleet-up-") as tmp:
        sup = Supervisor(cfg, config_path, Path(tmp))
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            for role in servers:
                sup.start(role, [], log_to_file=True)
            ports = sup.wait_ready(servers)
            addresses = {role: f"{dial_host(getattr(cfg, role).host)}:{ports[role]['grpc_port']}" for role in servers}
            sup.check_identity(addresses, ports)
            print(f"rolefleet: {', '.join(servers)} ready; logs in {out / 'logs'}", flush=True)
            if made_token is not None:
                print(f"rolefleet: every role refuses calls without the run's token, made for this run in "
                      f"{out / RUN_TOKEN_FILE} (readable by you alone); `rolefleet status --run {out}` "
                      "presents it", flush=True)
            endpoint = [f"actor.endpoint.url={endpoint_url(cfg, ports['actor']['endpoint_port'])}"
                        ] if "endpoint_port" in ports.get("actor", {}) and not cfg.actor.endpoint.url else []
            sup.start("coordinator", [f"{role}.address={a}" for role, a in addresses.items()] + endpoint,
                      log_to_file=False)
            return sup.watch("coordinator")
        finally:
            sup.stop_all()
            signal.signal(signal.SIGTERM, previous)

"""`rolefleet up`: start every role of a config as its own process on this machine, run, stop all.

Each role gets CUDA_VISIBLE_DEVICES from its device group (empty: CPU) and a ready file through
which it reports the ports it bound, so configs may use port 0 and runs never collide. Children die
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from rolefleet.common.config import ConfigError, RoleFleetConfig, dial_host, dump_config
from rolefleet.common.errors import RoleFleetError
from rolefleet.rpc.auth import write_run_token
from rolefleet.rpc.roles import fetch_status
from rolefleet.rpc.run_files import RUN_TOKEN_FILE
from rolefleet.rpc.server import StartupError

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0
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
    proc: subprocess.Popen
    ready_file: Path
    log_file: Optional[IO]

    def ports(self) -> Optional[dict]:
        try:
            return json.loads(self.ready_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


def _end_what_is_left(rp: RoleProcess) -> None:
    """After a role's process has ended: kill whatever is left of its process group (the session
    `start` gave it). A role killed by a signal cannot stop its descendants: worker ranks and a vLLM
    engine's processes would go on holding GPU memory and ports that the restarted role needs."""
    try:
        os.killpg(rp.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left
        pass


def role_env(cfg: RoleFleetConfig, role: str) -> dict[str, str]:
    env = dict(os.environ)
    gpus = cfg.devices.local_indices(role) if role != "coordinator" else []
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
        """Start `role`; servers log to runs/<name>/logs/<role>.log, the coordinator to the console."""
        ready = self.workdir / f"{role}.ready.json"
        ready.unlink(missing_ok=True)  # a restart: the dead process's ports are not this one's readiness
        self.overrides[role] = overrides
        log_file = open(self.logs / f"{role}.log", "a" if role in self.procs else "w") if log_to_file else None
        level = "info" if log_to_file else logging.getLevelName(logging.getLogger().level).lower()
        cmd = [sys.executable, "-m", "rolefleet.cli", "--log-level", level, "serve", role, *overrides,
               "--config", str(self.config_path), "--ready-file", str(ready)]
        # A session of its own: a Ctrl-C in the terminal reaches `up` alone, which stops the
        # children in order (coordinator first) instead of all at once.
        proc = subprocess.Popen(cmd, env=role_env(self.cfg, role), stdout=log_file, stderr=log_file,
                                start_new_session=True,
                                preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        self.procs[role] = RoleProcess(role, proc, ready, log_file)
        log.info("started %s (pid %d)", role, proc.pid)
        return self.procs[role]

    def wait_ready(self, roles: list[str]) -> dict[str, dict]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        ports: dict[str, dict] = {}
        while len(ports) < len(roles):
            for role in roles:
                rp = self.procs[role]
                if rp.proc.poll() is not None:
                    raise RoleFailed(f"{role} exited with code {rp.proc.returncode} before it was ready; "
                                     f"the end of {self.logs / (role + '.log')}:\n{self.log_tail(role)}")
                if role not in ports and (p := rp.ports()) is not None:
                    ports[role] = p
            if time.monotonic() > deadline:
                missing = sorted(set(roles) - set(ports))
                raise RoleFailed(f"roles not ready after {READY_TIMEOUT_S:.0f}s: {missing}")
            time.sleep(0.1)
        return ports

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
                code = rp.proc.poll()
                if code is None:
                    continue
                if role == main and not _killed(code):
                    return code
                if self.restarts.get(role, 0) >= self.cfg.run.max_restarts:
                    print(f"rolefleet: {role} exited with code {code} during the run and was restarted "
                          f"{self.restarts.get(role, 0)} times (run.max_restarts); stopping. The end of its log:\n"
                          f"{self.log_tail(role)}", file=sys.stderr, flush=True)
                    return code if role == main else 1
                self.restart(role, code)
            time.sleep(0.2)

    def restart(self, role: str, code: int) -> None:
        n = self.restarts[role] = self.restarts.get(role, 0) + 1
        backoff = min(RESTART_BACKOFF_S * 2 ** (n - 1), 30.0)
        print(f"rolefleet: {role} exited with code {code} during the run; restarting it in {backoff:.0f} s "
              f"({n} of {self.cfg.run.max_restarts})", file=sys.stderr, flush=True)
        old = self.procs[role]
        _end_what_is_left(old)
        time.sleep(backoff)
        if old.log_file is not None:
            old.log_file.close()
        ports = old.ports() or {}
        same_ports = [f"{role}.{key}={ports[name]}" for key, name in
                      (("port", "grpc_port"), ("metrics_port", "metrics_port"), ("http_port", "http_port"))
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
                try:
                    rp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs; killing it", rp.role, STOP_GRACE_S)
                    rp.proc.kill()
                    rp.proc.wait()
                _end_what_is_left(rp)
                if rp.log_file is not None:
                    rp.log_file.close()


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


def up(cfg: RoleFleetConfig) -> int:
    """Run the whole cluster locally. Returns the coordinator's exit code."""
    from rolefleet.serve import run_security

    cfg, made_token = with_run_token(cfg)
    try:
        run_security(cfg, "client")  # `up`'s own calls (the identity check) present the run's token and certificate
    except StartupError as exc:
        raise ConfigError(str(exc)) from None
    out = cfg.run.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    config_path.write_text(dump_config(cfg))  # every role reads the same resolved config
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
            sup.start("coordinator", [f"{role}.address={a}" for role, a in addresses.items()], log_to_file=False)
            return sup.watch("coordinator")
        finally:
            sup.stop_all()
            signal.signal(signal.SIGTERM, previous)

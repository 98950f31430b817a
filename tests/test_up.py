"""`rolefleet up` pieces that need no full run: the identity check of the servers it started, the
end of what a killed role leaves behind, and the wait for roles to start (what each is doing, the
start-up limit)."""

import re
from pathlib import Path

import pytest

from rolefleet.up import RoleFailed, Supervisor
from tests.e2e.procs import gone, rolefleet, terminate, wait_ready, write_config


@pytest.mark.procs
def test_up_checks_that_each_address_is_answered_by_the_server_it_started(make_config, tmp_path):
    cfg = make_config()
    config = write_config(cfg, tmp_path / "config.yaml")
    proc = rolefleet("serve", "reward", "--config", str(config), "--ready-file", str(tmp_path / "reward.json"))
    try:
        ready = wait_ready(proc, tmp_path / "reward.json")
        address = {"reward": f"127.0.0.1:{ready['grpc_port']}"}
        sup = Supervisor(cfg, Path(config), tmp_path)
        sup.check_identity(address, {"reward": ready})  # the process we started answers: fine
        with pytest.raises(RoleFailed, match="is another server .* not the reward this run started"):
            sup.check_identity(address, {"reward": dict(ready, instance_id="someone-else")})
        with pytest.raises(RoleFailed, match="does not answer GetStatus"):
            sup.check_identity({"reward": "127.0.0.1:1"}, {"reward": ready})
    finally:
        assert terminate(proc) == 0


@pytest.mark.procs
def test_what_a_killed_role_leaves_behind_is_ended(tmp_path):
    """A role killed by a signal cannot stop its own children (worker ranks, a vLLM engine's
    processes): the supervisor ends the rest of the role's process group before it restarts it."""
    import subprocess
    import sys
    import time

    from rolefleet.up import RoleProcess, _end_what_is_left

    marker = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
              f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    role = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)  # as Supervisor.start
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(marker.read_text())
    role.kill()
    role.wait()
    assert not gone(child)  # orphaned, still running
    _end_what_is_left(RoleProcess("actor", role, tmp_path / "ready.json", None))
    assert gone(child, timeout_s=10)
    _end_what_is_left(RoleProcess("actor", role, tmp_path / "ready.json", None))  # nothing left: no error


# --- waiting for the roles: their progress, and the start-up limit --------------------------------

FAKE_ROLE = """
import json, os, sys, time
from rolefleet.common import progress
progress.report("loading models")
progress.report("loading weights", 3, 8)
time.sleep(float(sys.argv[2]))
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    json.dump({"grpc_port": 1234}, f)
os.rename(tmp, sys.argv[1])
time.sleep(300)
"""


def fake_role(sup: Supervisor, tmp_path: Path, ready_after_s: float):
    """An `actor` that reports its stages through the progress file as a role does, then writes its
    ready file after `ready_after_s`; its clock starts once it has reported."""
    import os
    import subprocess
    import sys
    import time

    from rolefleet.common import progress
    from rolefleet.up import RoleProcess

    ready, reported = tmp_path / "actor.ready.json", tmp_path / "actor.progress.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", FAKE_ROLE, str(ready), str(ready_after_s)],
                            env=dict(os.environ, **{progress.PROGRESS_FILE_ENV: str(reported)}))
    deadline = time.monotonic() + 60
    while progress.latest(reported) is None or progress.latest(reported)["stage"] != "loading weights":
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    sup.procs["actor"] = RoleProcess("actor", proc, ready, None, progress_file=reported)
    return proc


@pytest.mark.procs
def test_up_shows_what_a_slow_role_is_doing_while_it_waits(tmp_path, monkeypatch, capsys):
    from rolefleet.common.config import parse_config

    monkeypatch.setattr("rolefleet.up.PROGRESS_EVERY_S", 0.2)
    sup = Supervisor(parse_config({"model": {"model_name_or_path": "m"}}), tmp_path / "config.yaml", tmp_path)
    proc = fake_role(sup, tmp_path, ready_after_s=1.5)
    try:
        assert sup.wait_ready(["actor"]) == {"actor": {"grpc_port": 1234}}
    finally:
        proc.kill()
        proc.wait()
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rolefleet: actor:")]
    assert shown and all(re.fullmatch(r"rolefleet: actor: loading weights \(3 of 8\), \d+ s", s) for s in shown)


@pytest.mark.procs
def test_a_role_past_its_start_up_limit_fails_naming_the_key_and_its_last_stage(tmp_path):
    from rolefleet.common.config import parse_config

    cfg = parse_config({"model": {"model_name_or_path": "m"}}, ["run.startup_timeout_s=1"])
    sup = Supervisor(cfg, tmp_path / "config.yaml", tmp_path)
    proc = fake_role(sup, tmp_path, ready_after_s=300)
    try:
        with pytest.raises(RoleFailed) as failed:
            sup.wait_ready(["actor"])
    finally:
        proc.kill()
        proc.wait()
    assert re.match(r"actor: loading weights \(3 of 8\), \d+ s: not ready within 1 s \(run.startup_timeout_s, set "
                    r"in the config\); if it is still making progress, give it longer with "
                    r"run.startup_timeout_s=SECONDS", str(failed.value))

"""`rolefleet up` pieces that need no full run: the identity check of the servers it started, and the
end of what a killed role leaves behind."""

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

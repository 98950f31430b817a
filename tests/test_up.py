"""`rolefleet up` pieces that need no full run: the identity check of the servers it started."""

from pathlib import Path

import pytest

from rolefleet.up import RoleFailed, Supervisor
from tests.e2e.procs import rolefleet, terminate, wait_ready, write_config


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

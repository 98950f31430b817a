"""A child that watches its parent (`common/orphans.py`: worker ranks, reward sandbox workers) ends
when the parent is killed, even while it is blocked and never reads its pipe."""

import subprocess
import sys
import time

import pytest

from tests.e2e.procs import gone

pytestmark = pytest.mark.procs

BLOCKED_CHILD = ("from rolefleet.common.orphans import exit_with_parent; exit_with_parent(1, 'test child'); "
                 "import time; time.sleep(300)")  # as a rank blocked in a collective


def start_parent(marker, watch: bool) -> tuple[subprocess.Popen, int]:
    """A parent process with one child, blocked for 5 minutes (watching its parent or not)."""
    child = BLOCKED_CHILD if watch else "import time; time.sleep(300)"
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"open({str(marker)!r}, 'w').write(str(c.pid)); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return parent, int(marker.read_text())


def test_a_blocked_child_exits_when_its_parent_is_killed(tmp_path):
    parent, child = start_parent(tmp_path / "watching.pid", watch=True)
    time.sleep(1.5)  # its watch is running: a live parent is not mistaken for a dead one
    assert not gone(child)
    parent.kill()
    parent.wait()
    assert gone(child, timeout_s=10)


def test_without_the_watch_the_blocked_child_outlives_its_parent(tmp_path):
    """The control: what the watch prevents."""
    parent, child = start_parent(tmp_path / "plain.pid", watch=False)
    parent.kill()
    parent.wait()
    try:
        assert not gone(child, timeout_s=3)
    finally:
        subprocess.run(["kill", "-9", str(child)], check=False)

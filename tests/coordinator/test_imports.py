"""The coordinator holds no model: importing it must not load transformers or any role core (a
coordinator image or pod without model libraries must run, and start fast)."""

import subprocess
import sys

import pytest


@pytest.mark.procs
def test_the_coordinator_imports_no_model_library_and_no_role_core():
    code = ("import sys, rolefleet.serve, rolefleet.coordinator.server, rolefleet.coordinator.loop; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'tokenizers', 'vllm') "
            "or m in ('rolefleet.actor.core', 'rolefleet.critic.core', 'rolefleet.reward.core')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

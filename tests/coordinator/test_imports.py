"""What importing a part loads: the coordinator holds no model, so importing it must not load
transformers or any role core (a coordinator image or pod without model libraries must run, and
start fast); the command line and the config load no torch until a command needs it."""

import subprocess
import sys

import pytest


def _python(code: str) -> str:
    """What `code` prints, run in a fresh interpreter (the modules loaded are that import's alone)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.procs
def test_the_coordinator_imports_no_model_library_and_no_role_core():
    assert _python(
        "import sys, rolefleet.serve, rolefleet.coordinator.server, rolefleet.coordinator.loop; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'tokenizers', 'vllm') "
        "or m in ('rolefleet.actor.core', 'rolefleet.critic.core', 'rolefleet.reward.core')); print(bad)") == "[]"


@pytest.mark.procs
def test_the_command_line_and_the_config_import_no_torch():
    """`rolefleet --help`, `status`, `scale` and `certs` answer in a fraction of a second: the config
    imports the RL maths' registries (and torch with them) only when a validator checks a name in
    them, and those commands' modules import nothing that loads torch."""
    assert _python(
        "import sys, rolefleet.cli, rolefleet.common.config, rolefleet.app.commands.remote, "
        "rolefleet.app.commands.certs, rolefleet.algos.presets; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))") == "[]"
    # A config that names a registry's entry is still checked against it (the maths load then).
    assert _python(
        "from rolefleet.common.config import parse_config, ConfigError\n"
        "try:\n    parse_config({'model': {'model_name_or_path': 'm'}}, ['actor.policy_loss=nope'])\n"
        "except ConfigError as e:\n    print(e)").endswith("actor.policy_loss: unknown policy loss 'nope'; valid: gspo, ppo_clip, sft (got 'nope')")

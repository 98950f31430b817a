"""The real test model learns to use the calculator, on a GPU (skipped without CUDA): the benchmark
of docs/benchmarks.md ("Multi-turn tool use"), shortened. After a light warm start (a minority of
its conversations call the tool), GRPO with the tools environment raises both the held-out
tool-use rate and the held-out accuracy, with the built-in environment and with the same task driven
by an agent written against the openai client through the actor's endpoint."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.real_model, pytest.mark.multiturn, pytest.mark.timeout(900)]


@pytest.mark.parametrize("way", ["env", "agent"])
def test_the_real_model_learns_to_call_the_calculator(real_model_dir, tmp_path, way):
    proc = subprocess.run([sys.executable, "benchmarks/tools_task.py", "--model", real_model_dir, "--out", str(tmp_path),
                           "--steps", "30", "--eval-prompts", "100", "--ways", way],
                          capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "tools_task.json").read_text())[way]
    before, after = result["warm_start"], result["after_rl"]
    assert after["tool_use_rate"] > before["tool_use_rate"], result
    assert after["accuracy"] > before["accuracy"], result

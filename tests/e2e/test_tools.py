"""Multi-turn, tool-using rollouts through `rolefleet up configs/demo_tools.yaml` (real role
processes on loopback): the tiny chat model, warm-started on tool-call conversations, calls the
calculator, the reward role's `tools` environment answers in its sandbox, and the run logs more
than one turn per sample. The run is in async mode, where each conversation's turns go between the
roles while the next batch generates (sync-mode conversations are the same episodes, tested
in-process in tests/coordinator/test_episodes.py)."""

import textwrap

import pytest

from rolefleet.app.tiny_model import make_tiny_model
from tests.conftest import built_once
from tests.e2e.procs import read_metrics, rolefleet

pytestmark = [pytest.mark.e2e, pytest.mark.multiturn, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    """A short warm start: enough for the tool-call format (most first turns call the calculator)."""
    return built_once(tmp_path_factory, "tools-model",
                      lambda out: make_tiny_model(out, task="tool_arithmetic", warm_start_steps=60))


def run_demo(model: str, out, *overrides: str) -> list[dict]:
    proc = rolefleet("up", "configs/demo_tools.yaml", f"model.model_name_or_path={model}", f"run.output_dir={out}",
                     "train.total_steps=3", "train.prompts_per_step=4", "train.samples_per_prompt=2",
                     "actor.num_threads=1", *overrides)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    assert "ended FINISHED after step 3/3" in output
    return read_metrics(out / "metrics.jsonl")


def test_the_tools_demo_in_async_mode_runs_conversations_with_the_calculator(tools_model, tmp_path):
    records = run_demo(tools_model, tmp_path / "run", "pipeline.mode=async", "pipeline.max_staleness=1")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["episode/turns/mean"] > 1.0, r
        assert r["episode/tool_calls/mean"] > 0 and 0 < r["episode/masked_token_frac"] < 1
        assert r["episode/env_errors"] == 0 and r["timing/env_s"] > 0
        assert r["reward/errors"] == 0
    # Each sample's lag is counted from its first turn's policy version, within the bound.
    assert all(r["pipeline/version_lag/max"] <= 1 for r in records)


def test_a_user_declared_tool_is_shown_to_the_model_and_run_by_the_reward_role(tools_model, tmp_path):
    """data.tools names a function of the user's, written here, named `calculator`: the prompts show
    it as they showed the built-in (the tiny template writes tool names only), the model warm-started
    on calculator calls calls it, and each call runs the user's function in the reward role's sandbox
    (it logs the call to a file), answered and counted like the built-in's. (The schema in the
    prompt: tests/tasks/test_render_tools.py.)"""
    calls = tmp_path / "calls.log"
    (tmp_path / "my_tools.py").write_text(textwrap.dedent(f'''
        import operator

        OPS = {{"+": operator.add, "-": operator.sub, "*": operator.mul}}

        def calculator(expression: str) -> int:
            """Evaluate a op b.

            Args:
                expression: two integers and + - or *, spaced
            """
            with open({str(calls)!r}, "a") as log:
                log.write(expression + "\\n")
            a, op, b = expression.split()
            return OPS[op](int(a), int(b))
        '''))
    out = tmp_path / "run"
    # Near greedy: at temperature 1 this short warm start writes mostly malformed calls, which never
    # reach a tool; its greedy calls are well-formed.
    records = run_demo(tools_model, out, f"data.tools=[{tmp_path}/my_tools.py:calculator]",
                       "sampling.temperature=0.05")
    calls_made = sum(r["episode/tool_calls/mean"] for r in records)
    assert calls_made > 0 and sum(r["episode/tool_errors/mean"] for r in records) < calls_made
    assert all(r["episode/env_errors"] == 0 and r["reward/errors"] == 0 for r in records)
    logged = calls.read_text().splitlines()
    assert logged and all(line for line in logged)  # the user's function ran, once per call it logged
    assert "my_tools.py:calculator" in (out / "config.yaml").read_text()

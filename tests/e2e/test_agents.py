"""Agent code of the user's through `rolefleet up` (real role processes on loopback): the reward
role runs the agent, written against the official `openai` client, in its sandbox; each episode is
a session of the actor's OpenAI-compatible endpoint; the coordinator trains the sessions'
trajectories with the agents' rewards. (The endpoint's sessions themselves: tests/actor/test_endpoint.py.)"""

import textwrap

import pytest

from rolefleet.app.tiny_model import make_tiny_model
from tests.conftest import built_once
from tests.e2e.procs import read_metrics, rolefleet

pytestmark = [pytest.mark.e2e, pytest.mark.multiturn, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    return built_once(tmp_path_factory, "tools-model",
                      lambda out: make_tiny_model(out, task="tool_arithmetic", warm_start_steps=60))


def run(model: str, out, *overrides: str, steps: int = 3) -> tuple[str, list[dict]]:
    proc = rolefleet("up", "configs/demo_agent.yaml", f"model.model_name_or_path={model}", f"run.output_dir={out}",
                     f"train.total_steps={steps}", "train.prompts_per_step=4", "train.samples_per_prompt=2",
                     "actor.num_threads=1", *overrides)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    assert f"ended FINISHED after step {steps}/{steps}" in output
    return output, read_metrics(out / "metrics.jsonl")


def test_the_calculator_agent_drives_multi_turn_episodes_that_train(tools_model, tmp_path):
    """configs/demo_agent.yaml as shipped, in async mode: the agent's tool calls come back as
    OpenAI function calls, its tool results extend the sessions (masked out of the loss)."""
    _, records = run(tools_model, tmp_path / "run", "pipeline.mode=async", "pipeline.max_staleness=1",
                     "sampling.temperature=0.05")
    for r in records:
        assert r["episode/turns/mean"] > 1.0 and r["episode/tool_calls/mean"] > 0, r
        assert 0 < r["episode/masked_token_frac"] < 1 and r["episode/env_errors"] == 0
        assert r["timing/env_s"] > 0 and r["reward/errors"] == 0
    assert all(r["pipeline/version_lag/max"] <= 1 for r in records)


def test_the_agent_s_return_is_the_reward_and_a_failing_agent_costs_its_episode_alone(tools_model, tmp_path):
    """An agent that rewards by the prompt it was given (a str here, the task's chat messages), and
    raises for one prompt in four: those episodes are counted and trained on nothing; the run goes on."""
    (tmp_path / "my_agent.py").write_text(textwrap.dedent('''
        import zlib

        async def agent(client, prompt, ground_truth, extra):
            reply = await client.chat.completions.create(model="policy", messages=prompt, max_tokens=8)
            assert reply.choices[0].message.role == "assistant"
            if zlib.crc32(prompt[-1]["content"].encode()) % 4 == 0:
                raise RuntimeError("this agent fails here")
            return 0.25 + len(ground_truth) % 2
        '''))
    output, records = run(tools_model, tmp_path / "run", f"reward.agent.path={tmp_path}/my_agent.py:agent",
                          "actor.rollout.max_turns=1", steps=4)
    failed = sum(r["episode/env_errors"] for r in records)
    assert failed > 0, records
    assert "RuntimeError: this agent fails here" in (tmp_path / "run" / "logs" / "reward.log").read_text()
    for r in records:
        assert r["episode/turns/mean"] == 1.0
        # Rewards are 0.25 or 1.25 for the agents that returned (reward/env: theirs alone), 0 (the
        # fallback) for those that failed.
        assert 0.25 <= r["reward/env/mean"] <= 1.25 and r["reward/mean"] <= r["reward/env/mean"]
    assert any(r["reward/mean"] > 0 for r in records)

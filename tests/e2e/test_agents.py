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
    # The endpoint says where its time went, with the updates (the agents' turns since the last one).
    assert all(r["actor/endpoint_engine_s"] > 0 and r["actor/endpoint_sequences_per_call"] >= 1
               for r in records if "actor/endpoint_requests" in r)
    assert any("actor/endpoint_requests" in r for r in records)


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


def test_a_stateful_environment_keeps_its_episode_s_state_and_is_closed_at_its_end(tools_model, tmp_path):
    """reward.agent.path naming a class: one object per episode, kept in its agent worker across the
    episode's turns (here: the calculator calls it answered), closed when the episode ends."""
    log = tmp_path / "closed.log"
    (tmp_path / "calc_env.py").write_text(textwrap.dedent(f'''
        import json
        import re

        TOOLS = [{{"type": "function", "function": {{"name": "calculator", "description": "a op b",
                  "parameters": {{"type": "object", "properties": {{"expression": {{"type": "string"}}}}}}}}}}]


        class Calculator:
            tools = TOOLS

            def reset(self, prompt, ground_truth, extra):
                self.answer, self.calls = ground_truth, 0
                return None  # the prompt as the data gave it

            def step(self, message):
                calls = message.get("tool_calls") or []
                if not calls:
                    numbers = re.findall(r"-?\\d+", message.get("content") or "")
                    return {{"observation": [], "done": True, "reward": float(numbers[-1:] == [self.answer])}}
                self.calls += len(calls)
                results = []
                for call in calls:
                    try:
                        a, op, b = json.loads(call["function"]["arguments"])["expression"].split()
                        value = str({{"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}}[op])
                    except Exception as exc:
                        value = f"error: {{exc}}"
                    results.append({{"role": "tool", "tool_call_id": call["id"], "content": value}})
                return {{"observation": results, "done": False}}

            def close(self):
                with open({str(log)!r}, "a") as f:
                    f.write(f"{{self.calls}}\\n")
        '''))
    _, records = run(tools_model, tmp_path / "run", f"reward.agent.path={tmp_path}/calc_env.py:Calculator",
                     "sampling.temperature=0.05")
    closed = log.read_text().splitlines()
    assert len(closed) == 3 * 4 * 2  # every episode's environment closed once
    assert sum(int(c) for c in closed) > 0  # and the calls it counted over the episode's turns
    for r in records:
        assert r["episode/turns/mean"] > 1.0 and r["episode/tool_calls/mean"] > 0, r
        assert r["episode/env_errors"] == 0 and 0 < r["episode/masked_token_frac"] < 1


def test_agents_outside_the_cluster_drive_the_episodes_through_the_endpoint(tools_model, tmp_path):
    """reward.agent.external: no agent runs in the cluster; a client of the test's (another thread,
    over loopback HTTP) claims each episode from the actor's endpoint with the run's token, drives it
    with the openai client, and posts its reward; the run trains those episodes and rewards."""
    import json
    import socket
    import threading
    import time
    import urllib.error
    import urllib.request

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    proc = rolefleet("up", "configs/demo_agent.yaml", f"model.model_name_or_path={tools_model}", f"run.output_dir={out}",
                     "train.total_steps=2", "train.prompts_per_step=2", "train.samples_per_prompt=2",
                     "actor.num_threads=1", "reward.agent.path=null", "reward.agent.external=true",
                     f"actor.endpoint.port={port}", "reward.agent.timeout_s=120")
    claimed, stop = [], threading.Event()

    def outside_agent():
        base = f"http://127.0.0.1:{port}"
        while not stop.is_set():
            token_file = out / "token"
            if not token_file.exists():
                time.sleep(0.1)
                continue
            token = token_file.read_text().strip()
            request = urllib.request.Request(f"{base}/v1/episodes", method="POST",
                                             headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    episode = json.load(reply)
            except (urllib.error.URLError, ConnectionError):  # not serving yet, or none waiting (404)
                time.sleep(0.05)
                continue
            client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["key"], max_retries=0)
            completion = client.chat.completions.create(model="policy", messages=episode["prompt"], max_tokens=16)
            reward = 1.0 if episode["ground_truth"] in (completion.choices[0].message.content or "") else 0.25
            posted = urllib.request.Request(f"{base}/v1/episodes/{episode['id']}/reward", method="POST",
                                            data=json.dumps({"reward": reward}).encode(),
                                            headers={"Authorization": f"Bearer {episode['key']}",
                                                     "Content-Type": "application/json"})
            urllib.request.urlopen(posted, timeout=10).close()
            claimed.append((episode["id"], reward))

    thread = threading.Thread(target=outside_agent, daemon=True)
    thread.start()
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        stop.set()
        thread.join(10)
    assert proc.returncode == 0, output[-4000:]
    assert "ended FINISHED after step 2/2" in output
    assert len(claimed) == 2 * 2 * 2  # every episode of both steps, claimed once
    records = read_metrics(out / "metrics.jsonl")
    for r in records:
        assert r["episode/env_errors"] == 0 and r["reward/env/mean"] >= 0.25, r


def test_openenv_s_example_environment_drives_the_episodes_and_its_reward_is_learned(tools_model, tmp_path):
    """configs/demo_openenv.yaml as shipped: OpenEnv's echo environment (written by `openenv init`,
    offline) in the agent workers, rewarding 0.1 a character of each reply over up to three turns.
    The model learns to earn more of it (its turns end before sampling.max_new_tokens, which ends an
    episode, so the conversations go on)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("openenv")
    subprocess.run([str(Path(sys.executable).parent / "openenv"), "init", "echo_task", "--output-dir", str(tmp_path)],
                   check=True, capture_output=True, timeout=120)
    env = f"{tmp_path}/echo_task/server/echo_task_environment.py:EchoTaskEnvironment"
    proc = rolefleet("up", "configs/demo_openenv.yaml", f"model.model_name_or_path={tools_model}",
                     f"run.output_dir={tmp_path / 'run'}", "train.total_steps=16", "actor.num_threads=1",
                     f"reward.agent.openenv.environment={env}")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 16 and all(r["episode/env_errors"] == 0 for r in records)
    first, last = (sum(r["reward/mean"] for r in part) / 4 for part in (records[:4], records[-4:]))
    # 1.28 -> 1.61 here (30 steps of the demo: 1.0 -> 2.9).
    assert last > first + 0.15, [round(r["reward/mean"], 2) for r in records]

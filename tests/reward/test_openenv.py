"""OpenEnv environments driving episodes (`reward.agent.openenv`, `reward/openenv_env.py`), with
OpenEnv's own example environment: the echo environment that `openenv init` writes (it answers a
message with itself, rewarded 0.1 a character, and never ends an episode). In the agent workers as
objects of its class, and as a running OpenEnv server (its own app, a real process on loopback that
takes one session at a time), against a real endpoint on loopback whose policy answers "a" * n on
its n-th turn."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rolefleet.actor.types import SamplingParams
from rolefleet.common.config import ConfigError, parse_config
from rolefleet.common.config.reward import AgentSection, OpenEnvSection
from rolefleet.reward.agents import Agents
from rolefleet.reward.types import AgentItem
from tests.helpers import scripted_chat_endpoint

pytest.importorskip("openenv")
pytestmark = pytest.mark.procs

TURNS = 3
ENV = "echo_task/server/echo_task_environment.py:EchoTaskEnvironment"


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory) -> Path:
    """OpenEnv's example environment as its CLI writes it (offline): a package echo_task/ with
    models.py (the action's `message`, the observation's `echoed_message` and `message_length`) and
    server/ (the Environment class, its FastAPI app)."""
    root = tmp_path_factory.mktemp("openenv")
    subprocess.run([str(Path(sys.executable).parent / "openenv"), "init", "echo_task", "--output-dir", str(root)],
                   check=True, capture_output=True, timeout=120)
    return root


@pytest.fixture(scope="module")
def endpoint(chat_model_dir):
    with scripted_chat_endpoint(chat_model_dir, lambda turn: "a" * turn, TURNS) as served:
        yield served


def run(endpoint, section: OpenEnvSection, extras: list[dict], prompt="Say something long.", **agent):
    store, url = endpoint
    agents = Agents(AgentSection(openenv=section, workers=1, timeout_s=30.0, **agent))
    try:
        ids = [f"o{i}-{time.monotonic_ns()}" for i in range(len(extras))]
        keys = store.open(ids, SamplingParams(max_new_tokens=8))
        outcomes = agents.run([AgentItem(f"{url}/sessions/{sid}/v1", key, prompt, "gt", extra)
                               for sid, key, extra in zip(ids, keys, extras)])
        return outcomes, store.close(ids)
    finally:
        agents.close()


# The echo environment rewards 0.1 a character: "a", "aa", "aaa" on the session's three turns.
EPISODE_REWARD = 0.1 * (1 + 2 + 3)


def test_the_echo_environment_s_objects_drive_episodes_in_the_agent_workers(endpoint, echo_env):
    store, _ = endpoint
    outcomes, trajectories = run(endpoint, OpenEnvSection(environment=str(echo_env / ENV)), [{}] * 3)
    for outcome, trajectory in zip(outcomes, trajectories):
        assert not outcome.error and outcome.reward == pytest.approx(EPISODE_REWARD)
        assert trajectory.turns == TURNS  # echo never ends an episode: the session's turns do
        prompt = store.tokenizer.decode(trajectory.prompt_ids.tolist())
        # The data's prompt and the reset observation make one user message (this tiny tokenizer
        # has no newline: <unk> between them).
        assert prompt.count("<|im_start|>user") == 1
        assert "Say something long." in prompt and prompt.index("Say") < prompt.index("Echo Task environment ready!")
        response = store.tokenizer.decode(trajectory.response_ids.tolist())
        # The observation's text field (echoed_message) is the user's next message: the model's reply.
        assert "<|im_start|>user\naa<|im_end|>" in response


def test_a_running_openenv_server_drives_episodes_one_session_at_a_time(endpoint, echo_env):
    """The example's own app (uvicorn, a real process) allows one session: the other episodes wait
    for it (CAPACITY_REACHED), and each ends as in-process; action and observation fields come from
    the server's /schema."""
    code = textwrap.dedent(f'''
        import socket, sys, uvicorn
        sys.path.insert(0, {str(echo_env)!r})
        from echo_task.server.app import app
        sock = socket.socket(); sock.bind(("127.0.0.1", 0))
        print(sock.getsockname()[1], flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
        ''')
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        outcomes, trajectories = run(endpoint, OpenEnvSection(url=f"http://127.0.0.1:{port}"), [{}] * 3,
                                     prompt=[{"role": "system", "content": "Be brief."}])
    finally:
        server.kill()
        server.wait(timeout=30)
    assert [o.error for o in outcomes] == [""] * 3
    assert [o.reward for o in outcomes] == [pytest.approx(EPISODE_REWARD)] * 3
    store, _ = endpoint
    # No user message in the data's prompt: the reset observation follows it as one.
    assert "<|im_start|>user\nEcho Task environment ready!" in store.tokenizer.decode(trajectories[0].prompt_ids.tolist())


NOT_CONCURRENT = '''
import time
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOG = {log!r}


class Say(Action):
    text: str
    volume: int = 1


class Heard(Observation):
    heard: str = ""
    words: int = 0


class Shared(Environment):
    """Does not isolate its objects (OpenEnv's flag unset): one episode at a time in a worker."""

    def __init__(self):
        super().__init__()
        self.turn = 0

    def reset(self, seed=None, level=0):
        with open(LOG, "a") as f:
            f.write(f"reset {{time.monotonic()}} {{seed}} {{level}}\\n")
        return Heard(heard="go", done=False)

    def step(self, action: Say) -> Heard:
        self.turn += 1
        return Heard(heard=action.text, words=1, done=self.turn == 2, reward=float(self.turn))

    def close(self):
        with open(LOG, "a") as f:
            f.write(f"close {{time.monotonic()}}\\n")

    @property
    def state(self):
        return State()
'''


def test_an_environment_that_shares_its_objects_runs_one_episode_at_a_time(endpoint, tmp_path):
    """Also: the action's only text field found among others, `done` ends the episode, reset gets the
    section's options with the record's `reset` over them (and only those it takes)."""
    log = tmp_path / "env.log"
    (tmp_path / "shared.py").write_text(NOT_CONCURRENT.format(log=str(log)))
    section = OpenEnvSection(environment=f"{tmp_path}/shared.py:Shared", reset={"seed": 7, "unknown": 1})
    outcomes, trajectories = run(endpoint, section, [{}, {"reset": {"level": 2}}])
    assert [o.reward for o in outcomes] == [3.0, 3.0] and [t.turns for t in trajectories] == [2, 2]
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [line[0] for line in lines] == ["reset", "close", "reset", "close"]  # never two at once
    assert sorted((line[2], line[3]) for line in lines if line[0] == "reset") == [("7", "0"), ("7", "2")]


def test_bad_openenv_settings_are_config_errors_naming_the_key(endpoint, echo_env, tmp_path):
    env = str(echo_env / ENV)
    with pytest.raises(ConfigError, match=r"reward.agent.openenv.action_field: the action has no field 'text' "
                                          r"\(its fields: message\)"):
        Agents(AgentSection(openenv=OpenEnvSection(environment=env, action_field="text"), workers=1))
    (tmp_path / "untyped.py").write_text(textwrap.dedent('''
        from openenv.core.env_server.interfaces import Environment

        class Untyped(Environment):
            def reset(self): ...
            def step(self, action): ...
            @property
            def state(self): ...
        '''))
    with pytest.raises(ConfigError, match="Untyped.step names no Action class of its own"):
        Agents(AgentSection(openenv=OpenEnvSection(environment=f"{tmp_path}/untyped.py:Untyped"), workers=1))
    with pytest.raises(ConfigError, match="is not a file"):
        Agents(AgentSection(openenv=OpenEnvSection(environment=f"{tmp_path}/none.py:Env"), workers=1))
    base = {"model": {"model_name_or_path": "m"}}
    for openenv, message in (({}, "set url .* or environment"), ({"url": "h", "environment": "a:B"}, "one of them"),
                             ({"url": "echo:8000"}, "not an http"), ({"environment": "envs/echo"}, "not of the form"),
                             ({"url": "http://e:1", "prompt": "neither"}, "prompt")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**base, "reward": {"agent": {"openenv": openenv}}})
    with pytest.raises(ConfigError, match="each drives the episodes alone"):
        parse_config({**base, "reward": {"agent": {"openenv": {"url": "http://e:1"}, "path": "a.py:f"}}})


def test_a_server_that_is_not_there_fails_its_episodes_naming_the_url(endpoint):
    outcomes, _ = run(endpoint, OpenEnvSection(url="http://127.0.0.1:9"), [{}])
    assert "reward.agent.openenv.url: GET http://127.0.0.1:9/schema failed" in outcomes[0].error
    assert json.dumps(outcomes[0].reward) == "0.0"

"""The tools environment runs the user's own tools (`data.tools: [path/to/file.py:function]`) in
its sandbox workers: a call with good arguments answers with the function's return value, and one
with bad arguments, one that raises, dies or passes `tool_timeout_s` answers with an error the model
reads (naming the tool), counted in tool_errors / tool_timeouts; the worker and the other calls go on."""

import os
import time
from pathlib import Path

import pytest

from rolefleet.common.config import ConfigError, RewardSection
from rolefleet.reward.core import RewardCore
from rolefleet.reward.definition import definition_digest
from rolefleet.reward.env_tools import tool_call_text
from rolefleet.reward.types import EnvItem
from tests.e2e.procs import children_of
from tests.reward.user_tools import SPAWNED_SLEEP

pytestmark = [pytest.mark.multiturn, pytest.mark.procs]
TOOLS_FILE = Path(__file__).with_name("user_tools.py")
TOOL_TIMEOUT_S = 1.0


def env_section(*entries: str, **options) -> RewardSection:
    section = RewardSection(env={"name": "tools", "workers": 1, "timeout_s": 20, "memory_mb": 512,
                                 "options": {"tool_timeout_s": TOOL_TIMEOUT_S, **options}})
    section.env.run_user_tools(list(entries))  # what the whole config does from data.tools
    return section


@pytest.fixture(scope="module")
def core():
    core = RewardCore(env_section(f"{TOOLS_FILE}:lookup", f"{TOOLS_FILE}:calculator", tools=["calculator", "python"]))
    yield core
    core.close()


def turn(*calls: tuple[str, dict]) -> EnvItem:
    text = "".join(tool_call_text(name, arguments) for name, arguments in calls)
    return EnvItem("Look it up.", "", [{"role": "assistant", "content": text}], {})


def sandbox_pids() -> set[int]:
    return {pid for pid in children_of(os.getpid()) if b"sandbox_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()}


def test_a_user_tool_answers_with_its_return_value(core):
    text, as_json, builtin, calc = core.step([
        turn(("lookup", {"word": "ab", "times": 2})),
        turn(("lookup", {"word": "ab", "tags": ["x"]}), ("lookup", {"word": "cd", "tags": []})),
        turn(("python", {"code": "print(6 * 7)"})),
        turn(("calculator", {"expression": "1 + 1"}))])
    assert text.observation == [{"role": "tool", "content": "ABAB"}] and not text.done
    assert (text.tool_calls, text.tool_errors, text.tool_timeouts) == (1, 0, 0)
    # JSON for a dict; each call in a process of its own, so no call sees another's state.
    assert [m["content"] for m in as_json.observation] == ['{"word": "ab", "tags": ["x"], "calls": 1}',
                                                           '{"word": "cd", "tags": [], "calls": 1}']
    assert builtin.observation[0]["content"] == "42"  # the built-ins of the options go on
    assert calc.observation[0]["content"] == "user says 1 + 1"  # a user tool named like a built-in replaces it


def test_a_user_tool_that_fails_answers_with_an_error_the_model_reads_and_is_counted(core):
    workers = sandbox_pids()
    start = time.monotonic()
    raised, died, slow, spawned, bad, ok = core.step([
        turn(("lookup", {"word": "zz", "how": "raise"})),
        turn(("lookup", {"word": "zz", "how": "exit"})),
        turn(("lookup", {"word": "zz", "how": "sleep"})),
        turn(("lookup", {"word": "zz", "how": "spawn"})),
        turn(("lookup", {"word": 3}), ("lookup", {"words": "a"}), ("lookup", {}),
             ("lookup", {"word": "a", "how": "shout"})),
        turn(("lookup", {"word": "Ok", "how": "lower"}))])
    assert time.monotonic() - start < 8 * TOOL_TIMEOUT_S  # the slow ones were killed at the tool's deadline
    assert raised.observation[0]["content"] == "error: tool 'lookup' raised LookupError: no entry for zz"
    assert died.observation[0]["content"] == "error: tool 'lookup' died (exit code 7) before it answered"
    for o in (slow, spawned):
        assert o.observation[0]["content"] == f"error: tool 'lookup' timed out after {TOOL_TIMEOUT_S:g} s"
        assert (o.tool_calls, o.tool_errors, o.tool_timeouts) == (1, 1, 1) and not o.done and not o.error
    assert [m["content"] for m in bad.observation] == [
        "error: tool 'lookup': argument 'word': expected a string, got 3",
        "error: tool 'lookup': unknown argument(s) words; takes word, times, how, tags",
        "error: tool 'lookup': missing argument(s) word",
        "error: tool 'lookup': argument 'how': expected one of \"upper\", \"lower\", \"sleep\", \"raise\", \"exit\", "
        "\"spawn\", got \"shout\""]
    assert (bad.tool_calls, bad.tool_errors, bad.tool_timeouts) == (4, 4, 0)
    assert (raised.tool_errors, died.tool_errors) == (1, 1) and not raised.done  # the model may try again
    assert ok.observation[0]["content"] == "ok" and ok.tool_errors == 0
    assert sandbox_pids() == workers  # no worker was lost to a tool
    time.sleep(1.5)  # what the timed-out tool started went with it
    assert not spawned_sleeps()


def spawned_sleeps() -> list[Path]:
    wanted = f"sleep\0{SPAWNED_SLEEP}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted:
                found.append(entry)
        except OSError:
            continue
    return found


def test_a_user_tool_file_that_cannot_be_imported_fails_the_reward_role_at_start(tmp_path):
    broken = tmp_path / "tools.py"
    broken.write_text("import no_such_module\n\ndef find(q: str) -> str:\n    return q\n")
    with pytest.raises(ConfigError, match=r"cannot load the environment: .*user tool .*tools.py:find \(data.tools\) "
                                          r"could not be loaded: ModuleNotFoundError"):
        RewardCore(env_section(f"{broken}:find"))


def test_editing_a_user_tool_gives_the_reward_a_new_version(tmp_path):
    tool = tmp_path / "tools.py"
    tool.write_text("def find(q: str) -> str:\n    return q\n")
    before = definition_digest(env_section(f"{tool}:find"))
    assert definition_digest(env_section(f"{tool}:find")) == before
    tool.write_text("def find(q: str) -> str:\n    return q.upper()\n")
    assert definition_digest(env_section(f"{tool}:find")) != before

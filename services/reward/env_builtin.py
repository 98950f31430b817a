"""Built-in environments (`reward.env.name`), run in the reward role's sandbox workers like user
environments: the standard library only (docs/environments.md).

An environment is a function `step(prompt, messages, ground_truth, extra, **options) -> dict`: the
conversation so far (the record's prompt; then `messages`, the assistant turns and the observations
between them, the last one the assistant turn to answer) in, its answer out:

    {"observation": [{"role": "tool", "content": "936"}],   # or a str (a user message); None when done
     "done": False,
     "reward": None,                                         # optional: added to the sample's score
     "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}  # optional counts, for the metrics

It keeps no state between calls (everything it needs is in the conversation), so any replica of
the reward role can answer any turn, and a repeated call answers the same.
"""

from __future__ import annotations

import re
from typing import Any

from rolefleet.reward.env_tools import TOOLS, ToolCall, ToolResult, parse_tool_calls
from rolefleet.reward.user_tools import load_user_tools, run_user_tool

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def tools(prompt: str, messages: list[dict], ground_truth: str, extra: dict, *,
          tools: tuple[str, ...] = ("calculator", "python"), user_tools: tuple[str, ...] = (),
          python_timeout_s: float = 5.0, tool_timeout_s: float = 5.0, max_output_chars: int = 2000) -> dict:
    """Tool calling: each `<tool_call>` of the last assistant turn runs and its result comes back as
    a `tool` message; a turn without tool calls is the model's answer and ends the episode. A
    malformed call, an unknown tool and a failed or timed-out tool answer with an error message,
    which the model reads like any result (and which the metrics count). `user_tools`: the user's
    functions of data.tools (path/to/file.py:function), each call under `tool_timeout_s`; one named
    like a built-in takes its place."""
    calls = parse_tool_calls(messages[-1]["content"])
    if not calls:
        return {"observation": None, "done": True}
    users = load_user_tools(user_tools)
    names = [*(t for t in tools if t not in users), *users]
    observation, errors, timeouts = [], 0, 0
    for call in calls:
        if isinstance(call, str):
            r = ToolResult(f"error: {call}", True)
        elif call.name in users:
            r = run_user_tool(users[call.name], call.arguments, tool_timeout_s, max_output_chars)
        elif call.name not in tools:
            r = ToolResult(f"error: unknown tool {call.name!r}; tools: {', '.join(names)}", True)
        else:
            r = _run(call, python_timeout_s, max_output_chars)
        errors += r.error
        timeouts += r.timed_out
        observation.append({"role": "tool", "content": r.content})
    return {"observation": observation, "done": False, "tool_calls": len(calls), "tool_errors": errors,
            "tool_timeouts": timeouts}


def _prepare_tools(*, user_tools: tuple[str, ...] = (), **_options) -> None:
    """Import the user's tools as the worker starts: a file that cannot be imported fails the
    reward role's start, naming it, rather than every call of the run."""
    load_user_tools(user_tools)


tools.prepare = _prepare_tools  # called by the sandbox worker with the options, when it loads `tools`


def _run(call: ToolCall, python_timeout_s: float, max_output_chars: int) -> ToolResult:
    if call.name == "python":
        return TOOLS["python"](call.arguments, python_timeout_s, max_output_chars)
    return TOOLS[call.name](call.arguments)


def feedback(prompt: str, messages: list[dict], ground_truth: str, extra: dict, *, max_attempts: int = 2,
             message: str = "That is not correct. Check your work and answer again.") -> dict:
    """A second attempt: a wrong answer (its last number is not the ground truth's) is told so and
    answered again, up to `max_attempts` answers; a right one ends the episode."""
    answer = _NUMBER.findall(messages[-1]["content"])
    right = bool(answer) and _same_number(answer[-1], ground_truth)
    attempts = sum(m["role"] == "assistant" for m in messages)
    if right or attempts >= max_attempts:
        return {"observation": None, "done": True}
    return {"observation": [{"role": "user", "content": message}], "done": False}


def _same_number(a: str, b: Any) -> bool:
    try:
        return float(a) == float(str(b).strip())
    except ValueError:
        return False


BUILTIN = {"tools": "tools", "feedback": "feedback"}  # reward.env.name -> function of this module

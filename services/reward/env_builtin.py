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

from rolefleet.reward.env_tools import TOOLS, ToolCall, parse_tool_calls

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def tools(prompt: str, messages: list[dict], ground_truth: str, extra: dict, *,
          tools: tuple[str, ...] = ("calculator", "python"), python_timeout_s: float = 5.0,
          max_output_chars: int = 2000) -> dict:
    """Tool calling: each `<tool_call>` of the last assistant turn runs and its result comes back as
    a `tool` message; a turn without tool calls is the model's answer and ends the episode. A
    malformed call, an unknown tool and a failed or timed-out tool answer with an error message,
    which the model reads like any result (and which the metrics count)."""
    calls = parse_tool_calls(messages[-1]["content"])
    if not calls:
        return {"observation": None, "done": True}
    observation, errors, timeouts = [], 0, 0
    for call in calls:
        if isinstance(call, str):
            result, error, timed_out = f"error: {call}", True, False
        elif call.name not in tools:
            result, error, timed_out = f"error: unknown tool {call.name!r}; tools: {', '.join(tools)}", True, False
        else:
            r = _run(call, python_timeout_s, max_output_chars)
            result, error, timed_out = r.content, r.error, r.timed_out
        errors += error
        timeouts += timed_out
        observation.append({"role": "tool", "content": result})
    return {"observation": observation, "done": False, "tool_calls": len(calls), "tool_errors": errors,
            "tool_timeouts": timeouts}


def _run(call: ToolCall, python_timeout_s: float, max_output_chars: int):
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

"""Running user-declared tools (`data.tools: [path/to/file.py:function]`) for the `tools`
environment, inside its sandbox worker (docs/environments.md, "Your own tools").

The worker imports the tool's file once (`load_user_tools`); each call then runs in a child forked
from the worker, so that:
- a call past its deadline (`tool_timeout_s`) is killed with whatever it started, and the model
  reads a timeout instead of the whole turn failing at `reward.env.timeout_s`;
- a call that crashes, exits or runs out of memory (the child keeps the worker's address-space
  limit, `reward.env.memory_mb`) costs that call only, never the worker;
- a call leaves no state behind for the next one: the environment answers the same whichever
  worker or replica runs it.
Standard library only, like the rest of the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rolefleet.common.orphans import exit_with_parent
from rolefleet.reward.env_tools import ToolResult
from rolefleet.reward.tool_schema import check_arguments, split_entry, user_tool_schema

UserTool = tuple[Callable, dict]  # the function and its schema
_LOADED: dict[str, UserTool] = {}  # by entry: a worker imports each file once
_READ_BYTES = 1 << 16


def load_user_tools(entries: tuple[str, ...] | list[str]) -> dict[str, UserTool]:
    """{tool name: (function, schema)} of `entries`, imported on first use in this process."""
    from rolefleet.reward.sandbox_worker import load  # the worker's own loader: same module naming and path

    tools = {}
    for entry in entries:
        if entry not in _LOADED:
            file, function = split_entry(entry)
            schema = user_tool_schema(entry)
            try:
                _LOADED[entry] = (load("file", str(Path(file)), function), schema)
            except Exception as e:  # noqa: BLE001 - whatever the file's import raised
                raise ImportError(f"user tool {entry} (data.tools) could not be loaded: {type(e).__name__}: {e}") \
                    from None
        fn, schema = _LOADED[entry]
        tools[schema["function"]["name"]] = (fn, schema)
    return tools


def run_user_tool(tool: UserTool, arguments: dict, timeout_s: float, max_output_chars: int) -> ToolResult:
    """Call the tool with `arguments` (checked against its schema first) in a forked child; its return
    value as text (JSON for a dict or list, else str()) is the result, and a bad call, an exception,
    a crash or a timeout an error message naming the tool."""
    fn, schema = tool
    name = schema["function"]["name"]
    if (problem := check_arguments(schema, arguments)) is not None:
        return ToolResult(f"error: tool {name!r}: {problem}", True)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(fn, arguments, write_end, max_output_chars)
    os.close(write_end)
    try:
        reply, timed_out = _read(read_end, timeout_s)
    finally:
        os.close(read_end)
    if timed_out:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # its own group: what it started goes too
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return ToolResult(f"error: tool {name!r} timed out after {timeout_s:g} s", True, timed_out=True)
    try:
        answer = json.loads(reply)
    except ValueError:
        return ToolResult(f"error: tool {name!r} died ({_how(status)}) before it answered", True)
    if "error" in answer:
        return ToolResult(_cut(f"error: tool {name!r} {answer['error']}", max_output_chars), True)
    return ToolResult(answer["ok"])


def _child(fn: Callable, arguments: dict, write_end: int, max_output_chars: int) -> None:
    code = 0
    try:
        os.setpgid(0, 0)
        exit_with_parent(3, "user tool")  # in its own group, the sandbox's kill of the worker misses it
        try:
            answer = {"ok": _cut(as_text(fn(**arguments)), max_output_chars)}
        except BaseException as exc:  # noqa: BLE001 - the tool's failure is the model's to read
            answer = {"error": f"raised {type(exc).__name__}: {exc}"}
        data = json.dumps(answer).encode()
        while data:
            data = data[os.write(write_end, data):]
    except BaseException:  # noqa: BLE001 - nothing may unwind into the worker's own loop
        code = 1
    finally:
        os._exit(code)


def _read(fd: int, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the child writes, and whether it passed the deadline first."""
    deadline = time.monotonic() + timeout_s
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"", True
        chunk = os.read(fd, _READ_BYTES)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)


def as_text(value) -> str:
    """What the model reads of a tool's return value: JSON for a dict or list, else str()."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        try:
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "\n...(truncated)"

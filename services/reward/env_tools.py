"""Tools for multi-turn rollouts, and the tool-call format the model writes (docs/environments.md).

Runs in the reward role's sandbox workers (`sandbox_worker.py`): the standard library only, no
torch, no RoleFleet config. A tool call is the Qwen/Hermes format, one JSON object per block:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347 * 29"}}
    </tool_call>

Each tool is described by a JSON schema (`TOOL_SCHEMAS`) in the form chat templates take as
`apply_chat_template(..., tools=[...])`, so the prompt shows the model the same tools the
environment runs.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
MAX_EXPONENT = 64          # 9**64 has 62 digits; larger powers are refused, not computed
MAX_RESULT_DIGITS = 200    # a calculator result longer than this is an error, not an observation


@dataclass
class ToolResult:
    content: str        # what the model reads (its error message when `error`)
    error: bool = False
    timed_out: bool = False


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """Every `<tool_call>` block of an assistant turn, in order: a ToolCall, or a str saying why the
    block is malformed (not JSON, no name, arguments that are not an object). An unclosed last
    block (the turn ran out of tokens inside it) is read to the end of the text."""
    calls: list[ToolCall | str] = []
    for match in TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except ValueError as exc:
            calls.append(f"malformed tool call (not JSON: {exc.msg} at character {exc.pos})")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append('malformed tool call: expected {"name": ..., "arguments": {...}}')
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"malformed tool call to {value['name']!r}: arguments must be an object")
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


# --- calculator ------------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def _arguments(arguments: dict, name: str) -> tuple[Any, list[str]]:
    """The one argument `name` of a tool call, and the names of any others."""
    return arguments.get(name), sorted(k for k in arguments if k != name)


def calculator(arguments: dict) -> ToolResult:
    """Arithmetic on numbers: + - * / // % ** and parentheses (no names, no calls)."""
    expression, unexpected = _arguments(arguments, "expression")
    if unexpected:
        return ToolResult(f"error: unexpected argument(s) {', '.join(unexpected)}; takes `expression`", True)
    if not isinstance(expression, str) or not expression.strip():
        return ToolResult("error: `expression` must be a non-empty string", True)
    if len(expression) > 500:
        return ToolResult("error: expression longer than 500 characters", True)
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return ToolResult("error: division by zero", True)
    except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
        return ToolResult(f"error: {exc}", True)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    text = repr(value) if isinstance(value, float) else str(value)
    if len(text) > MAX_RESULT_DIGITS:
        return ToolResult(f"error: result has more than {MAX_RESULT_DIGITS} digits", True)
    return ToolResult(text)


# --- python ---------------------------------------------------------------------------------------

def python(arguments: dict, timeout_s: float = 5.0, max_output_chars: int = 2000) -> ToolResult:
    """Run `code` in a fresh interpreter (isolated mode: no user site packages or paths, an empty
    environment, a scratch working directory of its own, removed after) under the worker's own
    memory limit, killed with everything it started past `timeout_s`. What it prints is the
    result; a traceback is an error. Limits of time and memory, not a jail: the program runs as the
    reward server's user (docs/environments.md)."""
    code, unexpected = _arguments(arguments, "code")
    if unexpected:
        return ToolResult(f"error: unexpected argument(s) {', '.join(unexpected)}; takes `code`", True)
    if not isinstance(code, str) or not code.strip():
        return ToolResult("error: `code` must be a non-empty string", True)
    with tempfile.TemporaryDirectory(prefix="rolefleet-python-tool-") as scratch:
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env={"PATH": "/usr/bin:/bin"}, cwd=scratch, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as exc:
            return ToolResult(f"error: could not run python: {exc}", True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # Its own session: the program and anything it started go together.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ToolResult(f"error: timed out after {timeout_s:g} s", True, timed_out=True)
    if proc.returncode != 0:
        tail = (stderr or "").strip().splitlines()[-3:]
        return ToolResult(_cut("error: " + ("\n".join(tail) or f"exit code {proc.returncode}"), max_output_chars), True)
    return ToolResult(_cut(stdout.rstrip("\n") or "(no output)", max_output_chars))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "\n...(truncated)"


TOOLS: dict[str, Callable[..., ToolResult]] = {"calculator": calculator, "python": python}

TOOL_SCHEMAS: dict[str, dict] = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                       "description": "the expression, e.g. 347 * 29"}}, "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run a Python program; what it prints is returned.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string",
                       "description": "the program"}}, "required": ["code"]}}},
}


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the model writes it (warm-start traces, tests)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'

"""An agent written against the OpenAI client, trained as it is (docs/environments.md, "Your own
agent"; configs/demo_agent.yaml).

RoleFleet calls `agent` once per episode with an `openai.AsyncOpenAI` client of the episode's
session: each completion it asks for is the policy's turn, sampled with the run's sampling and
recorded token for token. It offers the model a calculator, runs the model's calls itself, and
returns the episode's reward: 1 when the first number of the model's final answer is the right one
(as the built-in `numeric_match` scores it). With `reward.agent.options: {score: false}` it returns 0
and leaves the scoring to the reward role's sources (`benchmarks/tools_task.py` compares it so with
the built-in `tools` environment under the same `math` reward).
"""

from __future__ import annotations

import ast
import json
import operator
import re

# The built-in calculator's schema, word for word: the model sees the prompt the `tools` environment's runs show it.
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                   "description": "the expression, e.g. 347 * 29"}}, "required": ["expression"]}}}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_TURNS = 3


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"cannot evaluate {expression!r}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


async def agent(client, prompt, ground_truth, extra, score=True):
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        # The reply goes back as it came: the session's next request must extend its conversation.
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except ValueError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
        if reply.choices[0].finish_reason == "length":
            break
    if not score:
        return 0.0
    last = messages[-1]
    final = (last.get("content") or "") if last["role"] == "assistant" else ""
    numbers = re.findall(r"-?\d+", final)
    return 1.0 if numbers and numbers[0] == ground_truth.strip() else 0.0

"""A task where a tool helps: 3-4 digit arithmetic, with a calculator the model may call
(`reward.env.name: tools`; docs/environments.md).

Its prompts are chat messages (rendered with the model's chat template and the tools of
`data.tools`); the ground truth is the exact integer result, which the `math` or `numeric_match`
reward reads as the last number of the model's final answer. `tool_trace` writes the conversation
a tool user has on a record: the supervised warm start of `rolefleet tiny-model --task
tool_arithmetic` teaches a tiny model the format from it.
"""

from __future__ import annotations

import json
import random

from rolefleet.tasks import PromptRecord

QUESTION = "What is {a} {op} {b}?"
OPS = "+-*"
WARM_START_TOOL_SHARE = 0.3  # conversations of `tool_arithmetic_sft` that call the calculator


def tool_arithmetic(size: int, seed: int) -> list[PromptRecord]:
    """"What is a op b?" with op in + - *: a and b of 3-4 digits for + and -, a of 3 digits and b of
    2 for * (results up to 5-6 digits); exact integer answers. Millions of distinct problems."""
    rng = random.Random(seed)
    records = []
    for _ in range(size):
        op = rng.choice(OPS)
        if op == "*":
            a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        else:
            a, b = rng.randrange(100, 10000), rng.randrange(100, 10000)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        question = QUESTION.format(a=a, op=op, b=b)
        records.append(PromptRecord([{"role": "user", "content": question}], str(result),
                                    {"expression": f"{a} {op} {b}"}))
    return records


def tool_call(name: str, arguments: dict) -> str:
    """A Hermes-format tool call, compact JSON (fewer tokens for a character-level model)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


def tool_trace(record: PromptRecord) -> list[dict[str, str]]:
    """The assistant's side of a conversation that uses the calculator: the call, its result as
    the tool answers it, and the final answer."""
    return [{"role": "assistant", "content": tool_call("calculator", {"expression": record.extra["expression"]})},
            {"role": "tool", "content": record.ground_truth},
            {"role": "assistant", "content": record.ground_truth}]


def tool_arithmetic_sft(size: int, seed: int) -> list[PromptRecord]:
    """`tool_arithmetic`'s problems as whole conversations for a supervised warm start (`algorithm:
    sft`, configs/tools_warm_start.yaml): a share (`WARM_START_TOOL_SHARE`) call the calculator
    (`tool_trace`), the others answer at once, so the RL run that follows starts from a policy that
    knows the call format and that it may answer without the tool. Their assistant messages train."""
    rng = random.Random(seed * 7919 + 1)
    records = []
    for record in tool_arithmetic(size, seed):
        trace = tool_trace(record) if rng.random() < WARM_START_TOOL_SHARE else [
            {"role": "assistant", "content": record.ground_truth}]
        records.append(PromptRecord([*record.prompt, *trace], record.ground_truth, record.extra))
    return records

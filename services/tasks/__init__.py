"""Prompt datasets with verifiable answers: built-in generators by name (`data.task`) and prompt
files (`data.path`, JSONL or Parquet; see `files` and docs/data.md)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolefleet.common.config import ConfigError


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as the actor receives it (chat template already applied), its ground truth, and
    the dataset's other columns, passed through to the reward (JSON-serializable values). A task
    generator may give chat messages as the prompt; the dataset renders them to text."""

    prompt: str | list[dict[str, str]]
    ground_truth: str
    extra: dict[str, Any] = field(default_factory=dict)
    # The prompt as the data gave it, before the template (text or chat messages): what an agent
    # (reward.agent) is handed to drive its episode with. None: `prompt` is it.
    original: Any = field(default=None, compare=False, repr=False)

    @property
    def given(self) -> Any:
        return self.prompt if self.original is None else self.original


class DataError(ConfigError):
    """A data file, or a data setting, that cannot give prompts. The message starts with the
    config key to change (`data.path: data.jsonl:3: ...`), as every config problem does."""


def addition(size: int, seed: int) -> list[PromptRecord]:
    """"a+b=" with a, b in [0, 19]; the answer is the decimal sum. 400 distinct problems."""
    rng = random.Random(seed)
    records = []
    for _ in range(size):
        a, b = rng.randrange(20), rng.randrange(20)
        records.append(PromptRecord(f"{a}+{b}=", str(a + b)))
    return records


ARITHMETIC_QUESTION = "What is {a} {op} {b}? Answer with the number only."


def arithmetic_chat(size: int, seed: int) -> list[PromptRecord]:
    """A chat model's task: "What is a + b?" or "a - b" with a, b in [10, 99], as a user message
    (rendered with the model's chat template); the answer is the decimal result, which the `math`
    reward finds as the response's last number. 16,200 distinct problems."""
    rng = random.Random(seed)
    records = []
    for _ in range(size):
        a, b, op = rng.randrange(10, 100), rng.randrange(10, 100), rng.choice("+-")
        question = ARITHMETIC_QUESTION.format(a=a, op=op, b=b)
        records.append(PromptRecord([{"role": "user", "content": question}], str(a + b if op == "+" else a - b)))
    return records


def _tool_arithmetic(size: int, seed: int) -> list[PromptRecord]:
    from rolefleet.tasks.tools import tool_arithmetic  # import cycle: the task's module imports this one

    return tool_arithmetic(size, seed)


def _tool_arithmetic_sft(size: int, seed: int) -> list[PromptRecord]:
    from rolefleet.tasks.tools import tool_arithmetic_sft

    return tool_arithmetic_sft(size, seed)


TASKS: dict[str, Callable[[int, int], list[PromptRecord]]] = {"addition": addition,
                                                              "arithmetic_chat": arithmetic_chat,
                                                              "tool_arithmetic": _tool_arithmetic,
                                                              "tool_arithmetic_sft": _tool_arithmetic_sft}


def make_task(name: str, size: int, seed: int) -> list[PromptRecord]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](size, seed)

"""Built-in prompt datasets with verifiable answers, by name (`data.task` in the config)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    ground_truth: str


def addition(size: int, seed: int) -> list[PromptRecord]:
    """"a+b=" with a, b in [0, 19]; the answer is the decimal sum. 400 distinct problems."""
    rng = random.Random(seed)
    records = []
    for _ in range(size):
        a, b = rng.randrange(20), rng.randrange(20)
        records.append(PromptRecord(f"{a}+{b}=", str(a + b)))
    return records


TASKS: dict[str, Callable[[int, int], list[PromptRecord]]] = {"addition": addition}


def make_task(name: str, size: int, seed: int) -> list[PromptRecord]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](size, seed)


def load_jsonl(path: str | Path) -> list[PromptRecord]:
    """Records from a JSONL file of {"prompt": str, "ground_truth": str} objects (ground_truth
    optional). A malformed line is a ValueError naming the file and the line."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    records.append(_record(line, f"{path}:{lineno}"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _record(line: str, where: str) -> PromptRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with a 'prompt', got {type(obj).__name__}")
    prompt, truth = obj.get("prompt"), obj.get("ground_truth", "")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if truth is None or isinstance(truth, (dict, list)):
        raise ValueError(f"{where}: 'ground_truth' must be a string or a number, got {truth!r}")
    return PromptRecord(prompt, str(truth))

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
    """Records from a JSONL file of {"prompt": str, "ground_truth": str} objects."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                records.append(PromptRecord(str(obj["prompt"]), str(obj.get("ground_truth", ""))))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'prompt' ({e})") from None
    if not records:
        raise ValueError(f"{path} holds no records")
    return records

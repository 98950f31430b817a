"""Rule-based reward functions: (prompt, response, ground_truth) -> float, looked up by name."""

from __future__ import annotations

import re
from collections.abc import Callable

from rolefleet.algos.registry import Registry

RewardFn = Callable[[str, str, str], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 when the response equals the ground truth (surrounding whitespace ignored), else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


@REWARD_FUNCTIONS.register("numeric_match")
def numeric_match(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 when the first number in the response equals the ground-truth number, else 0.0."""
    found = _NUMBER.search(response)
    try:
        return 1.0 if found is not None and float(found.group()) == float(ground_truth) else 0.0
    except ValueError:
        return 0.0

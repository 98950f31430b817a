"""The `math` reward: the final answer of a response compared with the ground truth as mathematics.

The reward role runs `math_reward` in its worker processes (rolefleet.reward.sandbox), which import
this module by name: it imports nothing of RoleFleet and no torch, since the workers must start fast
and live under an address-space limit. The registry (rolefleet.reward.functions) imports it only
when `math` is called in-process, so that loading a config never pays for sympy.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Optional

from math_verify import parse, verify

# A response's final answer, by the conventions models are trained to follow, in order of trust.
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# A number with thousands separators, decimals or a plain fraction (1,000  -3.5  1/2); a trailing
# sentence period is not part of it.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
# math_verify's own time limits, in whole seconds: they use SIGALRM, so they only work on a main
# thread. The worker processes call this on their main thread; their hard limit
# (reward.user_timeout_s, the worker is killed) covers what an alarm cannot interrupt, such as
# sympy multiplying out 9^(9^(9^9)) in C.
_ALARM_S = 5


def last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
        # unbalanced (a response cut off inside the box): try an earlier one
    return None


def extract_answer(response: str) -> Optional[str]:
    """The final answer of a response: the last `\\boxed{}`, else the text after the last `####`,
    else the last number; None when it gives none."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    hashes = [m.group(1).strip().rstrip(".").strip() for m in _HASHES.finditer(response)]
    if hashes and hashes[-1]:
        return hashes[-1]
    numbers = _NUMBER.findall(response)
    return numbers[-1].replace(",", "") if numbers else None


def gold_answer(ground_truth: str) -> str:
    """The reference answer: after the last `####` (a full GSM8K solution), inside the last
    `\\boxed{}`, or the whole (stripped) text. Raises ValueError when there is none."""
    if "####" in ground_truth:
        answer = ground_truth.rsplit("####", 1)[1].strip()
    elif _BOXED.search(ground_truth):
        answer = last_boxed(ground_truth) or ""
    else:
        answer = ground_truth.strip()
    if not answer:
        raise ValueError(f"ground truth {ground_truth[:80]!r} holds no answer")
    return answer


def _alarm_s() -> Optional[int]:
    return _ALARM_S if threading.current_thread() is threading.main_thread() else None


def math_reward(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    """1.0 when the response's final answer equals the ground truth as mathematics (0.5 = 1/2 =
    \\frac{1}{2}, 1,000 = 1000, 2\\sqrt{2} = \\sqrt{8}), 0.0 when it differs or the response gives
    no answer. A ground truth that is not mathematics raises ValueError (the sample's error)."""
    timeout = _alarm_s()
    # Both sides go in as \boxed{...}: math_verify then reads them as one LaTeX expression rather
    # than searching the text for something that looks like an answer.
    gold = parse(f"\\boxed{{{gold_answer(ground_truth)}}}", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"ground truth {ground_truth[:80]!r} does not parse as mathematics")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


def warm_up() -> None:
    """Run by a worker before it reports ready: math_verify builds its LaTeX parser on first use
    (about half a second), which would otherwise count against the first sample's deadline."""
    math_reward("", "\\boxed{\\frac{1}{2}}", "0.5", {})

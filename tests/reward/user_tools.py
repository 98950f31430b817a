"""User tools for the tools environment's tests: each behaves as its arguments ask."""

import os
import subprocess
import time
from typing import Literal, Optional

SPAWNED_SLEEP = "61.25"  # an odd length, so the test can find this very process
CALLS = []  # a call's side effects stay in its own process: the next call sees this empty


def lookup(word: str, times: int = 1, how: Literal["upper", "lower", "sleep", "raise", "exit", "spawn"] = "upper",
           tags: Optional[list[str]] = None):
    """Look a word up.

    Args:
        word: the word
        times: repeats
        how: what to do with it
    """
    CALLS.append(word)
    if how == "sleep":
        time.sleep(60)
    if how == "raise":
        raise LookupError(f"no entry for {word}")
    if how == "exit":
        os._exit(7)
    if how == "spawn":  # a process of its own, which a timeout must end too
        subprocess.Popen(["sleep", SPAWNED_SLEEP])
        time.sleep(60)
    if tags is not None:
        return {"word": word, "tags": tags, "calls": len(CALLS)}
    return (word.upper() if how == "upper" else word.lower()) * times


def calculator(expression: str) -> str:
    """A calculator of the user's own, which takes the built-in's place."""
    return f"user says {expression}"

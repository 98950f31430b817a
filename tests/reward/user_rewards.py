"""User reward functions for the reward tests: each misbehaves as its response asks."""

import ctypes
import os
import time


def misbehave(prompt, response, ground_truth, extra):
    if response == "raise":
        raise ZeroDivisionError("division by zero")
    if response == "sleep":
        time.sleep(60)
    if response == "exit":
        os._exit(7)
    if response == "segfault":
        ctypes.string_at(0)
    if response == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(1 << 24))
    if response == "text":
        return "1.0"
    if response == "nan":
        return float("nan")
    return float(len(response)) + extra.get("bonus", 0)


def lengths(prompts, responses, ground_truths, extras):
    """Batched: one call for many samples."""
    if "raise" in responses:
        raise RuntimeError("bad batch")
    if "short" in responses:
        return [1.0]
    return [len(r) if r != "none" else None for r in responses]


async def coroutine(prompt, response, ground_truth, extra):
    return 1.0


not_callable = 3

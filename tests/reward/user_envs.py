"""User environments for the environment tests: each misbehaves as the assistant's turn asks."""

import os
import time


def step(prompt, messages, ground_truth, extra):
    turn = messages[-1]["content"]
    if turn == "raise":
        raise KeyError("no such state")
    if turn == "sleep":
        time.sleep(60)
    if turn == "exit":
        os._exit(3)
    if turn == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(1 << 24))
    if turn == "not a dict":
        return "done"
    if turn == "no done":
        return {"observation": "hello"}
    if turn == "bad observation":
        return {"observation": [{"role": "tool"}], "done": False}
    if turn == "open without observation":
        return {"done": False}
    if turn == "nan reward":
        return {"done": True, "reward": float("nan")}
    if turn == "unknown key":
        return {"done": True, "score": 1}
    # A well-behaved one: a second attempt for a wrong answer, with the prompt and extra seen.
    if turn == ground_truth:
        return {"done": True, "reward": 1.0 + extra.get("bonus", 0)}
    return {"observation": f"not {turn}; {prompt} again", "done": False}

"""Stateful environments (`reward.agent.path` naming a class; docs/environments.md, "A stateful
environment"), run in the reward role's agent workers (`sandbox_worker.py`): the standard library
and the `openai` client only.

An environment object lives in one worker for its episode's life: made and `reset` when the
episode begins, `step`ped with each of the model's replies, `close`d when the episode ends (done,
at its limits, failed, past its deadline: its coroutine is cancelled and `close` still runs); a
worker that dies ends its own episodes alone. It holds whatever the episode needs (a sandbox, a
database, a repository checkout). The model's turns are completions of the episode's session of the
actor's endpoint, driven by the loop below as an agent of the user's would drive them.

    class Env:
        tools = [...]                                    # optional: function tools shown to the model
        def __init__(self, **options): ...
        def reset(self, prompt, ground_truth, extra):    # the first messages (None: the prompt as given)
        def step(self, message):                         # the model's reply, an OpenAI assistant message:
            return {"observation": ..., "done": ..., "reward": ...}   # as a stateless environment's step
        def close(self): ...                             # optional

Each method may be a coroutine function. The episode's reward is the sum of its steps' rewards.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class EnvironmentFailed(Exception):
    """The environment answered something malformed: the episode fails with this message."""


def is_environment(target: Any) -> bool:
    """Whether `target` is an environment class (reset and step) rather than an agent function."""
    return inspect.isclass(target) and callable(getattr(target, "reset", None)) and callable(getattr(target, "step", None))


async def drive(cls: type, options: dict, client: Any, prompt: Any, ground_truth: str, extra: dict,
                checked: Callable[[Any], dict | str]) -> float:
    """One episode of environment `cls` with the policy behind `client`; `checked`: the stateless
    environments' check of a step's answer (a dict, or why it is malformed)."""
    import openai  # the agent workers' client (this module runs there alone)

    env = cls(**options)
    total = 0.0
    try:
        first = await _value(env.reset(prompt, ground_truth, extra))
        messages = _messages(prompt if first is None else first)
        tools = list(getattr(env, "tools", None) or [])
        while True:
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages,
                                                             **({"tools": tools} if tools else {}))
            except openai.RateLimitError:  # the session's turns or tokens are spent: the episode ends there
                break
            choice = reply.choices[0]
            message = choice.message.model_dump(exclude_none=True)
            messages.append(message)
            step = checked(await _value(env.step(message)))
            if isinstance(step, str):
                raise EnvironmentFailed(f"step {step}")
            total += step["reward"] or 0.0
            if step["done"] or choice.finish_reason == "length":
                break
            messages += step["observation"]
    finally:
        if callable(close := getattr(env, "close", None)):
            await _value(close())
    return total


async def _value(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return list(value)
    raise EnvironmentFailed("reset returned neither text nor a list of messages (nor None: the prompt as given)")

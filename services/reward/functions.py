"""Built-in reward functions, looked up by name: `(prompt, response, ground_truth, extra, **options)
-> float`.

`extra` is the sample's extra dataset columns (a dict). A function's keyword-only parameters are its
options, set per source in the config (`{kind: function, function: format, pattern: "..."}`) and
checked against their annotations when the config loads. Functions marked `isolated` run in the
reward role's worker processes, under a deadline (see rolefleet.reward.sandbox).
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable
from typing import Annotated, Any, Optional

from pydantic import AfterValidator, ConfigDict, Field, ValidationError, create_model

from rolefleet.algos.registry import Registry
from rolefleet.common.config import ExpandedPath

RewardFn = Callable[..., float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def isolated(module: str, attr: str) -> Callable[[RewardFn], RewardFn]:
    """Mark a built-in to run in the worker processes as `attr` of `module` (a module that imports
    no torch: the workers live under an address-space limit)."""

    def mark(fn: RewardFn) -> RewardFn:
        fn.isolated = (module, attr)
        return fn

    return mark


def isolated_target(name: str) -> Optional[tuple[str, str]]:
    """(module, attr) the workers import for built-in `name`, or None when it runs in the server."""
    return getattr(REWARD_FUNCTIONS.get(name), "isolated", None)


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(prompt: str, response: str, ground_truth: str, extra: dict) -> float:
    """1.0 when the response equals the ground truth (surrounding whitespace ignored), else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


@REWARD_FUNCTIONS.register("none")
def no_reward(prompt: str, response: str, ground_truth: str, extra: dict) -> float:
    """0 for every sample: the reward comes from elsewhere (an agent's, an environment's)."""
    return 0.0


@REWARD_FUNCTIONS.register("numeric_match")
def numeric_match(prompt: str, response: str, ground_truth: str, extra: dict) -> float:
    """1.0 when the first number in the response equals the ground-truth number, else 0.0."""
    found = _NUMBER.search(response)
    try:
        return 1.0 if found is not None and float(found.group()) == float(ground_truth) else 0.0
    except ValueError:
        return 0.0


@REWARD_FUNCTIONS.register("math")
@isolated("rolefleet.reward.math_answers", "math_reward")
def math_answer(prompt: str, response: str, ground_truth: str, extra: dict) -> float:
    """1.0 when the response's final answer (the last \\boxed{}, else after the last ####, else the
    last number) equals the ground truth's (after ####, in \\boxed{}, or the whole text) as
    mathematics (math_verify: 0.5 = 1/2 = \\frac{1}{2}); 0.0 otherwise or with no answer."""
    from rolefleet.reward.math_answers import math_reward  # sympy (0.25 s) only when the math reward runs

    return math_reward(prompt, response, ground_truth, extra)


def _compiles(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from None
    return pattern


Pattern = Annotated[str, AfterValidator(_compiles)]


@REWARD_FUNCTIONS.register("regex")
def regex(prompt: str, response: str, ground_truth: str, extra: dict, *, pattern: Pattern,
          ignore_case: bool = False) -> float:
    """1.0 when `pattern` (a Python regular expression) matches somewhere in the response."""
    flags = re.IGNORECASE if ignore_case else 0
    return 1.0 if re.search(pattern, response, flags) else 0.0


@REWARD_FUNCTIONS.register("format")
def format_(prompt: str, response: str, ground_truth: str, extra: dict, *, pattern: Pattern) -> float:
    """1.0 when the whole response (surrounding whitespace ignored) matches `pattern`, with `.`
    matching newlines too: a format check such as `<think>.*</think>\\s*<answer>.*</answer>`."""
    return 1.0 if re.fullmatch(pattern, response.strip(), re.DOTALL) else 0.0


@REWARD_FUNCTIONS.register("length_penalty")
def length_penalty(prompt: str, response: str, ground_truth: str, extra: dict, *,
                   target: Annotated[int, Field(ge=1)], tokenizer: Optional[ExpandedPath] = None) -> float:
    """-(length - target) / target when the response is longer than `target`, else 0.0 (-1.0 at
    twice the target). Length in characters, or in tokens of `tokenizer` (a local directory or a
    hub id) when it is set."""
    length = len(_tokenizer(tokenizer)(response, add_special_tokens=False)["input_ids"]) if tokenizer else len(response)
    return -max(0, length - target) / target


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from transformers import AutoTokenizer  # only for a length reward in tokens: the config's checks import this module

    return AutoTokenizer.from_pretrained(name)


# --- options --------------------------------------------------------------------------------------

def _options(name: str) -> list[inspect.Parameter]:
    params = inspect.signature(REWARD_FUNCTIONS.get(name)).parameters.values()
    return [p for p in params if p.kind is p.KEYWORD_ONLY]


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` of built-in `name`, converted to the types its keyword-only parameters declare.
    Raises ValueError naming an unknown, missing or malformed option."""
    fn = REWARD_FUNCTIONS.get(name)
    hints = typing.get_type_hints(fn, include_extras=True)
    fields = {p.name: (hints.get(p.name, Any), ... if p.default is p.empty else p.default) for p in _options(name)}
    model = create_model(f"{name}_options", __config__=ConfigDict(extra="forbid", allow_inf_nan=False), **fields)
    try:
        return model.model_validate(options).model_dump()
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                valid = ", ".join(fields) or "none"
                problems.append(f"function {name} has no option {key!r} (its options: {valid})")
            elif err["type"] == "missing":
                problems.append(f"function {name} needs the option {key!r}")
            else:
                problems.append(f"option {key}: {err['msg'].removeprefix('Value error, ')}")
        raise ValueError("; ".join(problems)) from None

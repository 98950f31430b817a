"""The checks that need modules above the config: the built-in tasks, prompt sources and tools
(rolefleet.tasks) and the built-in reward functions (rolefleet.reward.functions).

`common/` sits below them (rolefleet.tasks imports ConfigError from here), so they are imported
when a validator runs, never when the config is imported: this file is the only place in the
config that reaches them (tests/test_layers.py holds it to that).
"""

from __future__ import annotations

from typing import Any, Optional

from rolefleet.common.config.base import _one_of


def known_task(name: Optional[str]) -> Optional[str]:
    from rolefleet.tasks import TASKS  # import cycle: rolefleet.tasks imports the config (module docstring)

    if name is not None and name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return name


def check_source(path: str, fmt: Optional[str], split: str, key: str) -> str:
    """The format of the prompt source `key`.path names, checked as far as it can be without reading
    it (ValueError naming the key)."""
    from rolefleet.tasks.files import check_source  # import cycle: as known_task's

    return check_source(path, fmt, split, key)


def check_tools(entries: list[str], key: str) -> None:
    """Each tool `key` names is a built-in or a function whose schema can be built (ValueError
    naming the entry, `data.tools[1]: ...`)."""
    from rolefleet.tasks.render import tool_schemas  # import cycle: as known_task's

    tool_schemas(entries, key)


def reward_function_names() -> list[str]:
    from rolefleet.reward.functions import REWARD_FUNCTIONS  # import cycle: it imports the config

    return REWARD_FUNCTIONS.names()


def known_reward_function(name: str) -> str:
    from rolefleet.reward.functions import REWARD_FUNCTIONS  # import cycle: it imports the config

    return _one_of(REWARD_FUNCTIONS, name)


def check_reward_options(function: str, options: dict[str, Any]) -> dict[str, Any]:
    """A built-in function's options, validated against its keyword-only parameters."""
    from rolefleet.reward.functions import check_options  # import cycle: it imports the config

    return check_options(function, options)

"""The environment of multi-turn rollouts, served by the reward role (`reward.env`,
docs/environments.md).

Built-in environments (`env_builtin.py`) and user files run the same way as user reward functions:
in worker processes of their own pool (`sandbox.py`), each call under a deadline
(`reward.env.timeout_s`) and each worker under an address-space limit (`reward.env.memory_mb`).
An environment that raises, hangs, runs out of memory or answers something malformed costs the
conversation it was answering, which ends there with the error; the request still succeeds.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rolefleet.common import metrics
from rolefleet.common.config import ConfigError
from rolefleet.common.config.reward import EnvSection
from rolefleet.reward.sandbox import LoadError, SandboxPool, Target, WorkerFailed
from rolefleet.reward.types import EnvItem, EnvOutcome

log = logging.getLogger(__name__)
KEY = "env"
SECTION = "reward.env"


def env_target(cfg: EnvSection) -> Target:
    """What the workers import: a built-in of `env_builtin`, or the user file's function."""
    if cfg.name:
        options = dict(cfg.options)
        if cfg.name == "tools" and cfg.user_tools:
            options["user_tools"] = [_resolved(entry) for entry in cfg.user_tools]
        return Target("module", "rolefleet.reward.env_builtin", cfg.name, options)
    file, _, fn = cfg.path.rpartition(":")
    return Target("file", str(Path(file).resolve()), fn)


def _resolved(entry: str) -> str:
    file, _, fn = entry.rpartition(":")
    return f"{Path(file).resolve()}:{fn}"


class Environment:
    """`step(items)` -> one EnvOutcome per item, computed in the environment's worker pool."""

    def __init__(self, cfg: EnvSection):
        self.cfg = cfg
        try:
            self.pool = SandboxPool({KEY: env_target(cfg)}, cfg.workers, cfg.timeout_s, cfg.memory_mb, SECTION)
        except LoadError as e:
            key = "name" if cfg.name else "path"
            raise ConfigError(f"{SECTION}.{key}: cannot load the environment: {e.errors[KEY]}") from None
        except WorkerFailed as e:
            raise ConfigError(f"{SECTION}: {e} ({SECTION}.memory_mb={cfg.memory_mb})") from None

    def step(self, items: list[EnvItem]) -> list[EnvOutcome]:
        rows = [(i.prompt, [dict(m) for m in i.messages], i.ground_truth, dict(i.extra)) for i in items]
        outcomes = [_outcome(o) for o in self.pool.step(KEY, rows)]
        if failed := [o.error for o in outcomes if o.error]:
            metrics.REWARD_ERRORS.labels("reward", KEY).inc(len(failed))
            log.warning("the environment failed on %d of %d conversations; first: %s", len(failed), len(items),
                        failed[0])
        return outcomes

    def close(self) -> None:
        self.pool.close()


def _outcome(value) -> EnvOutcome:
    if isinstance(value, str):  # why there is no answer: the conversation ends
        return EnvOutcome(observation=[], done=True, error=value)
    return EnvOutcome(observation=value["observation"], done=value["done"], reward=value["reward"],
                      tool_calls=value["tool_calls"], tool_errors=value["tool_errors"],
                      tool_timeouts=value["tool_timeouts"])

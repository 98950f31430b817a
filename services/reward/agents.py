"""Agent code of the user's (`reward.agent`, docs/environments.md, "Your own agent"), run by the
reward role: each episode's agent drives its session of the actor's OpenAI-compatible endpoint
with an `openai.AsyncOpenAI` client and returns the episode's reward.

Agents run in sandbox worker processes of their own pool (`sandbox.py`), many episodes at once in
each worker's event loop (`reward.agent.concurrency`), each under a deadline
(`reward.agent.timeout_s`) and each worker under an address-space limit. An agent that raises,
hangs or returns no number costs its episode, which is not trained; the request still succeeds.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rolefleet.common import metrics
from rolefleet.common.config import ConfigError, TlsSection
from rolefleet.common.config.reward import AgentSection
from rolefleet.reward.sandbox import LoadError, SandboxPool, Target, WorkerFailed
from rolefleet.reward.types import AgentItem, AgentOutcome

log = logging.getLogger(__name__)
KEY = "agent"
ROLE = "reward"  # whose certificate the agents' clients present
SECTION = "reward.agent"


class Agents:
    """`run(items)` -> one AgentOutcome per item, the agents run in the pool's workers."""

    def __init__(self, cfg: AgentSection, tls: TlsSection | None = None):
        """`tls`: the run's (security.tls): with it on, the agents' clients verify the endpoint
        with its CA, and present the reward role's certificate under mutual TLS."""
        self.cfg = cfg
        self.tls = client_tls(tls)
        if cfg.openenv is not None:  # a built-in stateful environment over the OpenEnv one
            key, target = f"{SECTION}.openenv", Target("module", "rolefleet.reward.openenv_env", "OpenEnvEpisode",
                                                       cfg.openenv.model_dump(mode="json"))
        else:
            file, _, fn = cfg.path.rpartition(":")
            key, target = f"{SECTION}.path", Target("file", str(Path(file).resolve()), fn, dict(cfg.options))
        try:
            self.pool = SandboxPool({KEY: target}, cfg.workers, cfg.timeout_s, cfg.memory_mb, SECTION)
        except LoadError as e:
            raise ConfigError(f"{key}: cannot load the agent: {e.errors[KEY]}") from None
        except WorkerFailed as e:
            raise ConfigError(f"{SECTION}: {e} ({SECTION}.memory_mb={cfg.memory_mb})") from None
        metrics.REWARD_ERRORS.labels("reward", KEY)

    def run(self, items: list[AgentItem]) -> list[AgentOutcome]:
        rows = [(i.base_url, i.key, i.prompt, i.ground_truth, dict(i.extra)) for i in items]
        outcomes = [AgentOutcome(error=o) if isinstance(o, str) else AgentOutcome(reward=o)
                    for o in self.pool.agents(KEY, rows, self.cfg.concurrency, self.cfg.timeout_s, self.tls)]
        if failed := [o.error for o in outcomes if o.error]:
            metrics.REWARD_ERRORS.labels("reward", KEY).inc(len(failed))
            log.warning("the agent failed on %d of %d episodes; first: %s", len(failed), len(items), failed[0])
        return outcomes

    def close(self) -> None:
        self.pool.close()


def client_tls(tls: TlsSection | None) -> dict[str, str] | None:
    """What an agent worker's HTTP client needs of the run's TLS (None: off): the CA it verifies the
    endpoint with (the system's roots without one), the reward role's certificate and key where
    the endpoint asks clients for one (mutual TLS), and the name to check in the endpoint's
    certificate instead of the host dialled (`security.tls.server_name`)."""
    if tls is None or not tls.enabled:
        return None
    files = tls.paths(ROLE)
    out = {"cafile": files["ca_file"]} if files["ca_file"] else {}
    if tls.mutual:
        out.update(certfile=files["cert_file"], keyfile=files["key_file"])
    if tls.server_name:
        out["server_name"] = tls.server_name
    return out

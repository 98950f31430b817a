"""RewardCore: scores samples with the configured reward sources and combines them. No gRPC here."""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from rolefleet.common import metrics
from rolefleet.common.config import RewardSection, TlsSection
from rolefleet.common.errors import FailedPrecondition, InvalidArgument, LimitExceeded
from rolefleet.common.role_types import RoleStatus
from rolefleet.reward.agents import Agents
from rolefleet.reward.definition import definition_digest
from rolefleet.reward.environments import KEY as ENV_KEY
from rolefleet.reward.environments import Environment
from rolefleet.reward.sandbox_worker import FLOAT32_MAX, Outcome
from rolefleet.reward.sources import Source, build_sources
from rolefleet.reward.types import AgentItem, AgentOutcome, EnvItem, EnvOutcome, ScoreItem, ScoreResult

ROLE = "reward"
log = logging.getLogger(__name__)


class RewardCore:
    """`score(items)` -> ScoreResult. A source that cannot score a sample (it raised, timed out,
    crashed its worker, or returned a non-number, NaN or inf) costs that sample that source's score:
    it counts `reward.fallback_score` instead, the sample's error says why, and
    rolefleet_reward_errors_total{function=<source>} counts it. The request itself succeeds: one
    bad sample must not cost a whole step. Only malformed or oversized requests are refused."""

    def __init__(self, cfg: RewardSection, tls: TlsSection | None = None):
        """`tls`: the run's (security.tls), for the agents' clients of the actor's endpoint."""
        self.cfg = cfg
        self.version = definition_digest(cfg)
        self.sources, self.pool = build_sources(cfg)
        self.env: Environment | None = None
        self.agents: Agents | None = None
        try:
            # Multi-turn rollouts' environment: its own worker pool, limits and metrics.
            self.env = Environment(cfg.env) if cfg.env.enabled else None
            self.agents = Agents(cfg.agent, tls) if cfg.agent.in_cluster else None
        except BaseException:
            self._close_sources()
            raise
        # Sources run side by side (a reward model on its GPU while workers run user functions).
        self._threads = ThreadPoolExecutor(len(self.sources), thread_name_prefix="reward-source") \
            if len(self.sources) > 1 else None
        self.scored = 0
        # Every source's error counter exists from the start, at 0: a dashboard shows "no errors" on
        # a healthy run instead of no data, and rate() sees the first error as an increase.
        for name in [source.name for source in self.sources] + ([ENV_KEY] if self.env else []):
            metrics.REWARD_ERRORS.labels(ROLE, name)

    def score(self, items: list[ScoreItem]) -> ScoreResult:
        self._check_sizes(items)
        if self.cfg.score_delay_s:  # a stand-in for a slower reward (benchmarks, tests)
            time.sleep(self.cfg.score_delay_s)
        if self._threads is None:
            outcomes = [self.sources[0].score(items)]
        else:
            outcomes = [f.result() for f in [self._threads.submit(s.score, items) for s in self.sources]]
        result = combine(self.sources, outcomes, self.cfg.fallback_score)
        self._count(result, len(items))
        return result

    def step(self, items: list[EnvItem]) -> list[EnvOutcome]:
        """The environment's answer to each conversation's last assistant turn (`reward.env`)."""
        if self.env is None:
            raise FailedPrecondition("this reward server has no environment: set reward.env.name or reward.env.path")
        self._check_sizes(items)
        for i, item in enumerate(items):
            if not item.messages or item.messages[-1]["role"] != "assistant":
                raise InvalidArgument(f"items[{i}].messages", "must end with the assistant turn to answer")
        return self.env.step(items)

    def run_agents(self, items: list[AgentItem]) -> list[AgentOutcome]:
        """Each episode's agent run to its end (`reward.agent`): its reward, or why it has none."""
        if self.agents is None:
            raise FailedPrecondition("this reward server runs no agent: set reward.agent.path or reward.agent.openenv")
        self._check_sizes(items)
        for i, item in enumerate(items):
            if not item.base_url.startswith(("http://", "https://")):
                raise InvalidArgument(f"items[{i}].base_url", "must be an http(s) URL")
        return self.agents.run(items)

    def _check_sizes(self, items: list[ScoreItem] | list[EnvItem] | list[AgentItem]) -> None:
        if not items:
            raise InvalidArgument("items", "no items to score")
        if len(items) > self.cfg.max_items_per_request:
            raise LimitExceeded("items", f"{len(items)} items exceed reward.max_items_per_request="
                                f"{self.cfg.max_items_per_request}")
        for i, item in enumerate(items):
            if (size := item.size()) > self.cfg.max_item_bytes:
                raise LimitExceeded(f"items[{i}]", f"{size} bytes exceed reward.max_item_bytes="
                                    f"{self.cfg.max_item_bytes}")

    def _count(self, result: ScoreResult, n: int) -> None:
        self.scored += n
        metrics.SAMPLES_SCORED.labels(ROLE).inc(n)
        for name, scores in result.sources.items():
            if failed := int(scores.isnan().sum()):
                metrics.REWARD_ERRORS.labels(ROLE, name).inc(failed)
                first = next(e for e, s in zip(result.errors, scores.tolist()) if math.isnan(s))
                log.warning("reward source %s failed on %d of %d samples; first: %s", name, failed, n, first)

    def status(self, include_digest: bool = False) -> RoleStatus:
        # No weights to hash: the digest is the reward definition's (`definition.py`), what tells
        # the replicas of a rolling update apart.
        return RoleStatus(ROLE, weights_digest=self.version)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self.env is not None:
            self.env.close()
        if self.agents is not None:
            self.agents.close()
        self._close_sources()

    def _close_sources(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for source in self.sources:
            source.close()


def combine(sources: list[Source], outcomes: list[list[Outcome]], fallback: float) -> ScoreResult:
    """Per sample: total = sum of weight x score over the sources, a failed source counting
    `fallback` as its score; raw scores per source with NaN where it failed; errors naming them."""
    n = len(outcomes[0])
    totals = [0.0] * n
    errors: list[list[str]] = [[] for _ in range(n)]
    raw: dict[str, torch.Tensor] = {}
    for source, outs in zip(sources, outcomes):
        values = []
        for i, outcome in enumerate(outs):
            if isinstance(outcome, str):
                errors[i].append(f"{source.name}: {outcome}")
                values.append(math.nan)
                totals[i] += source.weight * fallback
            else:
                values.append(outcome)
                totals[i] += source.weight * outcome
        raw[source.name] = torch.tensor(values, dtype=torch.float32)
    for i, total in enumerate(totals):
        if not math.isfinite(total) or abs(total) > FLOAT32_MAX:  # weights times huge scores
            errors[i].append(f"total: the weighted sum {total!r} is not a finite float32 number")
            totals[i] = fallback
    return ScoreResult(torch.tensor(totals, dtype=torch.float32), raw, ["; ".join(e) for e in errors])

"""The demo task is learnable: each algorithm raises the mean reward of the demo model.

In-process roles (no network), the shipped demo configs, fewer steps. Reward figures for full runs
are in docs/benchmarks.md.
"""

import asyncio
from pathlib import Path

import pytest

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.common.config import load_config
from rolefleet.common.tiny_model import make_tiny_model
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.state import RunStatus
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("demo-model"), task="addition", warm_start_steps=150)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config, overrides", [
    ("demo.yaml", []),
    ("demo_grpo.yaml", []),
    # Async: which policy version generates a batch depends on timing, so runs vary; lagged ones get
    # more steps (off-policy samples teach less per step).
    ("demo_grpo.yaml", ["pipeline.mode=async", "pipeline.max_staleness=0"]),
    ("demo_grpo.yaml", ["pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=80"]),
    ("demo.yaml", ["pipeline.mode=async", "pipeline.max_staleness=2"]),
], ids=["ppo", "grpo", "grpo-async-0", "grpo-async-1", "ppo-async-2"])
def test_demo_learns(demo_model, tmp_path, config, overrides):
    cfg = load_config(CONFIGS / config, [f"model.model_name_or_path={demo_model}",
                                         f"run.output_dir={tmp_path / 'run'}", "train.total_steps=60", *overrides])
    critic = (InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound))
              if cfg.preset.uses_critic else None)
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)),
                  InProcessRewardClient(RewardCore(cfg.reward)), critic)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, cfg.train.total_steps)))
    logger.close()
    rewards = [r["reward/mean"] for r in logger.records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.08, (first, last)

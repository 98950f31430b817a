"""The demo task is learnable: PPO raises the mean reward of the demo model (in-process roles)."""

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

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.mark.timeout(300)
def test_demo_config_learns(tmp_path):
    model = make_tiny_model(tmp_path / "model", task="addition", warm_start_steps=150)
    cfg = load_config(DEMO, [f"model.model_name_or_path={model}", f"run.output_dir={tmp_path / 'run'}",
                             "train.total_steps=60"])
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed)),
                  InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed)))
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, cfg.train.total_steps)))
    logger.close()
    rewards = [r["reward/mean"] for r in logger.records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.08, (first, last)

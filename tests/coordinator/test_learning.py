"""The demo task is learnable: each algorithm raises the mean reward of the demo model.

In-process roles (no network), the shipped demo configs, fewer steps. Reward figures for full runs
are in docs/benchmarks.md.
"""

import asyncio
from pathlib import Path

import pytest
import torch

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.config import load_config
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


def run_demo(demo_model, out, config: str, overrides: list[str]) -> list[dict]:
    """The step records of a run of a shipped demo config with in-process roles."""
    cfg = load_config(CONFIGS / config, [f"model.model_name_or_path={demo_model}", f"run.output_dir={out}",
                                         *overrides])
    critic = (InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound))
              if cfg.preset.uses_critic else None)
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)),
                  InProcessRewardClient(RewardCore(cfg.reward)), critic)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, cfg.train.total_steps)))
    logger.close()
    return logger.records


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("config, overrides", [
    ("demo.yaml", ["train.total_steps=40"]),
    ("demo_grpo.yaml", ["train.total_steps=60"]),
    # Async: which policy version generates a batch depends on timing, so runs vary; lagged ones get
    # more steps (off-policy samples teach less per step; PPO at staleness 2 fell short in 40 steps once,
    # in a full suite run on 2 cores; GRPO at staleness 1 plateaued near +0.07 from step 10 to 80 and
    # reached +0.16 by step 120, 2026-12-02). Staleness 0: the next test.
    ("demo_grpo.yaml", ["pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=120"]),
    ("demo.yaml", ["pipeline.mode=async", "pipeline.max_staleness=2", "train.total_steps=60"]),
    # LoRA adapters (r=16) alone train; they take a higher rate (0.22 -> 0.36 in 50 steps, 2026-12-02).
    ("demo_grpo.yaml", ["actor.lora.rank=16", "actor.lr=1e-3", "train.total_steps=50"]),
    # The long tail's options (issue 35): dynamic sampling, and the soft overlong penalty past 6 tokens.
    ("demo_grpo.yaml", ["train.dynamic_sampling.enabled=true", "train.overlong.mode=penalty",
                        "sampling.max_new_tokens=8", "train.overlong.buffer_tokens=2", "train.total_steps=60"]),
    # Partial rollouts: 2 tokens a step of the 4-token responses; a cut one ends in the next step.
    # Step 1 trains one group (the rest are carried), so it gets more steps: 0.21 -> 0.32 in 80 (and
    # +0.077 in 60, where plain GRPO gained +0.080 on the same machine, 2026-12-02).
    ("demo_grpo.yaml", ["pipeline.partial_rollouts.enabled=true", "pipeline.partial_rollouts.token_budget=2",
                        "train.total_steps=80"]),
], ids=["ppo", "grpo", "grpo-async-1", "ppo-async-2", "grpo-lora", "grpo-dynamic", "grpo-partial"])
def test_demo_learns(demo_model, tmp_path, config, overrides):
    rewards = [r["reward/mean"] for r in run_demo(demo_model, tmp_path / "run", config, overrides)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.08, (first, last)


@pytest.mark.timeout(300)
def test_async_at_staleness_zero_learns_step_for_step_as_sync(demo_model, tmp_path):
    """Async at `max_staleness: 0` trains every batch, in order, on the policy that generated it: the
    same run as sync, so it learns the demo task exactly as the sync GRPO run above does."""
    steps = ["train.total_steps=8"]
    sync = run_demo(demo_model, tmp_path / "sync", "demo_grpo.yaml", steps)
    stale0 = run_demo(demo_model, tmp_path / "async", "demo_grpo.yaml",
                      ["pipeline.mode=async", "pipeline.max_staleness=0", *steps])
    keys = ("reward/mean", "actor/loss", "actor/pg_loss", "policy_version")
    assert [[r[k] for k in keys] for r in stale0] == [[r[k] for k in keys] for r in sync]
    assert all(r["pipeline/version_lag/max"] == 0 for r in stale0)


@pytest.mark.timeout(300)
def test_dynamic_sampling_keeps_groups_without_signal_from_the_update(demo_model, tmp_path, monkeypatch):
    """Through the run loop: every sample an update trains on has a nonzero GRPO advantage (a group
    whose exact-match scores all agree would have zero), and the records count what was dropped."""
    advantages = []
    update = InProcessActorClient.update

    async def spy(self, step, policy_version, batch, targets, temperature):
        advantages.append([a.abs().max().item() for a in torch.split(targets.advantages, batch.response_lengths.tolist())])
        return await update(self, step, policy_version, batch, targets, temperature)

    monkeypatch.setattr(InProcessActorClient, "update", spy)
    records = run_demo(demo_model, tmp_path / "run", "demo_grpo.yaml",
                       ["train.total_steps=2", "train.dynamic_sampling.enabled=true", "train.prompts_per_step=16"])
    assert len(advantages) == 2 and all(a > 0 for step in advantages for a in step)
    assert sum(r["dynamic/dropped_groups"] for r in records) > 0  # the warm-started model agrees with itself often
    assert records[-1]["dynamic/dropped_groups_total"] == sum(r["dynamic/dropped_groups"] for r in records)
    assert all(r["dynamic/kept_groups"] == 16 or r["dynamic/batches"] == 4 for r in records)


@pytest.mark.timeout(300)
def test_the_overlong_filter_keeps_cut_responses_out_of_the_policy_update(demo_model, tmp_path, monkeypatch):
    """`train.overlong.mode: filter`: the actor's update gets the step's batch with the responses cut
    at the cap out of its loss mask (masked tokens get no gradient: tests/actor/test_loss_mask.py)."""
    from rolefleet.actor.types import FinishReason

    cut, trained = [], []
    generate, update = InProcessActorClient.generate, InProcessActorClient.update

    async def spy_generate(self, prompts, sampling, first_group_id=0):
        samples = await generate(self, prompts, sampling, first_group_id)
        cut.append([s.finish_reason == FinishReason.LENGTH for s in samples])
        return samples

    async def spy_update(self, step, policy_version, batch, targets, temperature):
        trained.append([bool(m.any()) for m in torch.split(batch.packed_train_mask(), batch.response_lengths.tolist())])
        return await update(self, step, policy_version, batch, targets, temperature)

    monkeypatch.setattr(InProcessActorClient, "generate", spy_generate)
    monkeypatch.setattr(InProcessActorClient, "update", spy_update)
    records = run_demo(demo_model, tmp_path / "run", "demo_grpo.yaml",
                       ["train.total_steps=2", "train.prompts_per_step=4", "sampling.max_new_tokens=2",
                        "train.overlong.mode=filter"])
    assert len(trained) == 2 and any(any(c) for c in cut) and not all(all(c) for c in cut)
    assert trained == [[not c for c in step] for step in cut]
    assert [r["overlong/filtered_fraction"] for r in records] == [sum(c) / len(c) for c in cut]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dynamic", [False, True])
def test_partial_rollouts_train_each_sample_once_within_the_bound(demo_model, tmp_path, monkeypatch, dynamic):
    """Through the run loop: responses cut at the budget are carried into the next step and trained
    there; the journal holds every trained sample once; each update is told the version of its
    oldest token (the actor checks it against the bound) and gets every token's rollout logprob for
    its importance-sampling correction. The same with dynamic sampling, which drops the groups
    without a signal as they finish."""
    from rolefleet.coordinator.journal import FILENAME, Journal

    updates = []
    update = InProcessActorClient.update

    async def spy(self, step, policy_version, batch, targets, temperature):
        updates.append((step, policy_version, targets.rollout_logprobs, batch.num_response_tokens))
        return await update(self, step, policy_version, batch, targets, temperature)

    monkeypatch.setattr(InProcessActorClient, "update", spy)
    records = run_demo(demo_model, tmp_path / "run", "demo_grpo.yaml",
                       ["train.total_steps=4", "train.prompts_per_step=8", "pipeline.partial_rollouts.enabled=true",
                        "pipeline.partial_rollouts.token_budget=1",
                        f"train.dynamic_sampling.enabled={str(dynamic).lower()}"])
    with Journal(tmp_path / "run" / FILENAME) as journal:
        trained = journal.trained_sample_ids()
    assert len(trained) == len(set(trained)) == sum(r["partial/trained_groups"] for r in records) * 8
    assert any(r["partial/older_token_frac"] > 0 for r in records)  # carried responses were trained
    assert [version for _, version, _, _ in updates] == [step - 1 - r["partial/max_lag"]
                                                         for (step, *_), r in zip(updates, records)]
    assert all(logprobs is not None and len(logprobs) == tokens for _, _, logprobs, tokens in updates)
    assert all(("dynamic/kept_groups" in r) == dynamic for r in records)

"""The demo task is learnable: each algorithm and rollout option raises the accuracy of the demo
model; and the run loop's step-level behaviour (async at staleness 0, dynamic sampling, the overlong
filter, partial rollouts), with in-process roles (no network).

A learning case is judged by an evaluation before step 1 and after the last (`eval.*`): every one of
the task's 400 problems, 4 samples each at the training temperature, the same random draws both
times, so the two figures differ by what the policy learned and little else. The training rewards
(a fresh 256 samples a step) are too noisy for a bar. Each bar sits several standard deviations
below the gains measured over seeds, and above what the run reaches with the learning rate at 0 or
the policy gradient's sign flipped: `scripts/learning_spread.py` measures both, docs/testing.md
records the figures.
"""

import asyncio
import json
from dataclasses import dataclass
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
from tests.conftest import built_once

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO_MODEL = {"task": "addition", "warm_start_steps": 150}  # what `make demo` builds


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    return built_once(tmp_path_factory, "demo-model", lambda out: make_tiny_model(out, **DEMO_MODEL))


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


@dataclass(frozen=True)
class Case:
    """A learning run: a shipped demo config, its overrides and length, and the evaluated gain that a
    healthy run clears (docs/testing.md: the spread it was set from)."""

    config: str
    overrides: tuple[str, ...]
    steps: int
    bar: float


# Steps and bars from scripts/learning_spread.py, 5 seeds each (docs/testing.md): each bar is at least
# 3 standard deviations below the mean gain and below the smallest measured; the learning rate at 0
# gains 0.000 in every case and the flipped policy gradient about -0.21.
CASES = {
    "ppo": Case("demo.yaml", (), 15, 0.04),  # +0.089 +- 0.007
    # GRPO at the demo's 6e-4 learns as fast but dips at random steps (a gain of +0.04 to +0.11
    # after 20 steps); at 3e-4 it climbs steadily.
    "grpo": Case("demo_grpo.yaml", ("actor.lr=3e-4",), 15, 0.04),  # +0.089 +- 0.011
    # Async: which policy version generates a batch depends on timing, so runs vary with the load.
    "grpo-async-1": Case("demo_grpo.yaml", ("actor.lr=3e-4", "pipeline.mode=async", "pipeline.max_staleness=1"),
                         15, 0.04),  # +0.089 +- 0.011
    "ppo-async-2": Case("demo.yaml", ("pipeline.mode=async", "pipeline.max_staleness=2"), 20, 0.05),  # +0.107 +- 0.012
    # LoRA adapters (r=16) alone train; they take a higher rate.
    "grpo-lora": Case("demo_grpo.yaml", ("actor.lora.rank=16", "actor.lr=1e-3"), 20, 0.05),  # +0.115 +- 0.018
    # The long tail's options (issue 35): dynamic sampling, and the soft overlong penalty past 6 tokens.
    "grpo-dynamic": Case("demo_grpo.yaml", ("train.dynamic_sampling.enabled=true", "train.overlong.mode=penalty",
                                            "sampling.max_new_tokens=8", "train.overlong.buffer_tokens=2"),
                         15, 0.05),  # +0.110 +- 0.010
    # Partial rollouts: 2 tokens a step of the 4-token responses; a cut one ends in the next step.
    "grpo-partial": Case("demo_grpo.yaml", ("pipeline.partial_rollouts.enabled=true",
                                            "pipeline.partial_rollouts.token_budget=2"), 15, 0.03),  # +0.072 +- 0.009
}


def every_addition_problem(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "ground_truth": str(a + b)}) + "\n"
                            for a in range(20) for b in range(20)))
    return path


def accuracy(demo_model, out: Path, case: Case, extra: list[str] = ()) -> list[tuple[int, float]]:
    """(step, mean exact-match reward of every problem's 4 samples) before the run and after it (and
    every `eval.every` steps when `extra` sets it). The evaluated problems are the training ones
    (the demo model is too small to generalise much to unseen sums in a few steps)."""
    out.mkdir(parents=True, exist_ok=True)
    records = run_demo(demo_model, out / "run", case.config, [
        *case.overrides, f"train.total_steps={case.steps}", f"eval.every={case.steps}",
        f"eval.path={every_addition_problem(out / 'problems.jsonl')}", "eval.max_prompts=400",
        "eval.temperature=1.0", "eval.samples_per_prompt=4", "eval.save_samples=false", *extra])
    return [(r["step"], r["eval/reward/mean"]) for r in records if "eval/reward/mean" in r]


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(CASES))
def test_demo_learns(demo_model, tmp_path, case_id):
    evals = accuracy(demo_model, tmp_path, CASES[case_id])
    (first_step, before), (last_step, after) = evals[0], evals[-1]
    assert (first_step, last_step) == (0, CASES[case_id].steps)
    assert after - before > CASES[case_id].bar, evals


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
                       ["train.total_steps=6", "train.prompts_per_step=8", "pipeline.partial_rollouts.enabled=true",
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

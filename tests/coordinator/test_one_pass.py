"""The coordinator's side of a one-pass update (`RoleFleetConfig.one_pass_update`): ComputeLogProbs
asks for the reference's logprobs alone, the update answers the policy's, and the run's records are
those of a run that recomputes them in a pass of their own."""

import asyncio

import pytest

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.state import RunStatus
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore


class CountingActor(InProcessActorClient):
    """Records what each ComputeLogProbs asked for."""

    def __init__(self, core):
        super().__init__(core)
        self.asked: list[bool] = []  # reference_only, per call

    async def compute_logprobs(self, batch, temperature, include_reference, reference_only=False):
        self.asked.append(reference_only)
        return await super().compute_logprobs(batch, temperature, include_reference, reference_only)


def run(cfg) -> tuple[list[dict], list[bool]]:
    actor = CountingActor(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound))
    critic = InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound))
    roles = Roles(actor, InProcessRewardClient(RewardCore(cfg.reward)), critic if cfg.preset.uses_critic else None)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    try:
        asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, cfg.train.total_steps)))
    finally:
        logger.close()
    return logger.records, actor.asked


@pytest.mark.parametrize("overrides, one_pass", [
    ((), True),
    (("actor.old_logprobs=recompute",), False),
    (("actor.ppo_epochs=2",), False),
    (("actor.num_mini_batches=2",), False),
    (("train.kl_coef=0.05",), False),  # the rewards' KL penalty needs the policy's logprobs first
    (("actor.is_correction=token_mask",), False),
    (("actor.is_correction=seq_truncate", "actor.kl_loss_coef=0.1"), True),
])
def test_a_one_pass_update_only_where_nothing_needs_the_old_logprobs_before_it(make_config, overrides, one_pass):
    assert make_config(*overrides).one_pass_update is one_pass


@pytest.mark.parametrize("mode", [
    ("algorithm=ppo",),
    ("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "actor.kl_loss_coef=0.01"),
])
def test_a_one_pass_run_records_what_a_recomputing_run_does(make_config, tmp_path, mode):
    common = (*mode, "train.total_steps=3", "train.samples_per_prompt=2", "actor.lr=1e-2")
    one_pass, asked = run(make_config(*common, f"run.output_dir={tmp_path / 'one'}"))
    recomputed, asked_again = run(make_config(*common, "actor.old_logprobs=recompute",
                                              f"run.output_dir={tmp_path / 'two'}"))
    assert asked == [True] * 3 and asked_again == [False] * 3  # the policy's pass is gone
    # The same steps: the same rollouts and rewards, the same metrics from the update's forward
    # as from a pass of their own, the same updates.
    for mine, theirs in zip(one_pass, recomputed, strict=True):
        assert mine["reward/mean"] == theirs["reward/mean"]
        for key in ("kl", "entropy", "rollout_train_logprob_diff/mean", "rollout_train_logprob_diff/max",
                    "actor/loss", "actor/pg_loss", "actor/grad_norm", "advantage/mean"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-5), key
    assert abs(one_pass[-1]["kl"]) > 1e-3  # the policy moved away from the reference, and the metric shows it

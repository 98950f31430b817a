"""The PPO loop against in-process roles (no network), and its pure pieces."""

import asyncio
import json

import pytest
import torch

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import DataSection, TrainSection
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.coordinator.targets import step_targets
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore

REQUIRED_KEYS = {"step", "policy_version", "reward/mean", "kl", "timing/step_s", "throughput/tokens_per_s"}


class RecordingReward:
    """The real reward core in-process, keeping every score it returned (or a planted one)."""

    def __init__(self, core: RewardCore, plant: dict[int, float] | None = None):
        self.inner = InProcessRewardClient(core)
        self.plant = plant or {}  # call number (1-based) -> value put in the first score
        self.returned: list[torch.Tensor] = []

    async def score(self, items):
        result = await self.inner.score(items)
        if len(self.returned) + 1 in self.plant:
            result.total[0] = self.plant[len(self.returned) + 1]
        self.returned.append(result.total)
        return result

    async def status(self):
        return await self.inner.status()

    async def close(self):
        pass


class StopAfterUpdate(InProcessActorClient):
    """Asks the run to stop while step `after` is in flight (a Stop RPC mid-step)."""

    def __init__(self, core: ActorCore, status: RunStatus, after: int):
        super().__init__(core)
        self.run_status, self.after = status, after

    async def update(self, step, *args):
        result = await super().update(step, *args)
        if step == self.after:
            self.run_status.request_stop()
        return result


def run(cfg, roles, status=None) -> tuple[RunStatus, list[dict]]:
    status = status or RunStatus(cfg.run.name, cfg.train.total_steps)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    try:
        asyncio.run(train(cfg, roles, logger, status))
    finally:
        logger.close()
    return status, read_records(cfg)


def read_records(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run.out / "metrics.jsonl").read_text().splitlines()]


def test_two_ppo_steps_in_process(make_config):
    cfg = make_config()
    actor, critic = ActorCore(cfg.actor), CriticCore(cfg.critic)
    actor_digest, critic_digest = actor.digest(), critic.digest()
    reward = RecordingReward(RewardCore(cfg.reward))
    roles = Roles(InProcessActorClient(actor), reward, InProcessCriticClient(critic))
    status, records = run(cfg, roles)
    assert status.state == RunState.FINISHED and status.step == 2
    assert actor.policy_version == 2 and actor.digest() != actor_digest
    assert critic.model_version == 2 and critic.digest() != critic_digest
    assert [r["step"] for r in records] == [1, 2] and [r["policy_version"] for r in records] == [1, 2]
    assert all(REQUIRED_KEYS <= set(r) for r in records)
    assert all(r["compile/graphs"] == 0 and r["compile/seconds"] == 0.0 for r in records)  # eager trainers
    # The logged reward is what the reward role returned for that step's samples.
    assert [r["reward/mean"] for r in records] == pytest.approx([s.mean().item() for s in reward.returned])
    assert all(len(s) == cfg.train.prompts_per_step for s in reward.returned)
    assert (cfg.run.out / "reward_curve.png").stat().st_size > 0
    assert any((cfg.run.out / "tensorboard").iterdir())


def test_stop_request_mid_run_ends_it_after_the_step_in_flight(make_config):
    cfg = make_config("train.total_steps=5")
    status = RunStatus(cfg.run.name, cfg.train.total_steps)
    actor = ActorCore(cfg.actor)
    roles = Roles(StopAfterUpdate(actor, status, after=2), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(CriticCore(cfg.critic)))
    status, records = run(cfg, roles, status)
    # Step 2 was in flight when the stop came: it completed and was logged in full; step 3 never began.
    assert status.state == RunState.STOPPED and status.step == 2 and actor.policy_version == 2
    assert [r["step"] for r in records] == [1, 2] and all(REQUIRED_KEYS <= set(r) for r in records)


def test_stop_before_the_first_step_runs_nothing(make_config):
    cfg = make_config("train.total_steps=5")
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor)), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(CriticCore(cfg.critic)))
    status = RunStatus(cfg.run.name, cfg.train.total_steps)
    status.request_stop()
    status, records = run(cfg, roles, status)
    assert status.step == 0 and roles.actor.core.policy_version == 0 and records == []
    assert status.state == RunState.STOPPED


def test_a_transient_failure_is_repeated_in_sync_mode_too_without_a_rollback(make_config):
    """`pipeline.retries` in both modes: the reward's second Score fails once and is sent again; no
    recovery (no step trained twice), and the checkpoint's counts hold the repeat."""
    from rolefleet.coordinator.journal import Journal
    from tests.coordinator.test_pipeline import SlowReward

    cfg = make_config("algorithm=grpo", "train.total_steps=2", "train.samples_per_prompt=2")
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor)), SlowReward(RewardCore(cfg.reward), fail=frozenset({2})),
                  None)
    status, records = run(cfg, roles)
    assert status.state == RunState.FINISHED and [r["step"] for r in records] == [1, 2]
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        assert not journal.rewound() and len(journal.trained_sample_ids()) == 2 * 8 * 2
    saved = json.loads((cfg.run.out / "checkpoints" / "step-00000002" / "coordinator.json").read_text())
    assert saved["counts"]["retries"] == 1 and saved["step"] == 2


@pytest.mark.parametrize("planted", [float("nan"), float("inf")])
def test_a_step_with_a_non_finite_reward_is_refused_before_any_update(make_config, planted):
    from rolefleet.coordinator.checks import StepRefused

    cfg = make_config("train.total_steps=3")
    actor, critic = ActorCore(cfg.actor), CriticCore(cfg.critic)
    reward = RecordingReward(RewardCore(cfg.reward), plant={2: planted})
    roles = Roles(InProcessActorClient(actor), reward, InProcessCriticClient(critic))
    status = RunStatus(cfg.run.name, cfg.train.total_steps)
    with pytest.raises(StepRefused, match="reward function 'exact_match' gave non-finite scores for prompt "):
        run(cfg, roles, status)
    # Step 1 stands; nothing of step 2 reached a role or the record.
    assert status.step == 1 and actor.policy_version == 1 and critic.model_version == 1
    assert actor.ledger.last_step == critic.ledger.last_step == 1
    assert [r["step"] for r in read_records(cfg)] == [1]


def test_a_reward_function_returning_nan_costs_its_samples_the_fallback_and_is_counted(make_config, monkeypatch):
    from rolefleet.reward.functions import REWARD_FUNCTIONS

    monkeypatch.setitem(REWARD_FUNCTIONS._items, "exact_match", lambda p, r, t, extra: float("nan"))
    cfg = make_config("reward.fallback_score=-1")
    actor = ActorCore(cfg.actor)
    roles = Roles(InProcessActorClient(actor), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(CriticCore(cfg.critic)))
    status, records = run(cfg, roles)
    # Every sample failed: each scored the fallback, the run went on, the step says how many failed.
    assert status.state == RunState.FINISHED and actor.policy_version == 2
    n = cfg.train.prompts_per_step * cfg.train.samples_per_prompt
    assert [r["reward/errors"] for r in records] == [n, n] and [r["reward/mean"] for r in records] == [-1, -1]
    assert "reward/exact_match/mean" not in records[0]  # the source scored nothing


def test_ppo_targets_put_the_score_on_the_last_token_and_penalise_kl():
    batch = SequenceBatch.from_lists([torch.tensor([1]), torch.tensor([2])],
                                     [torch.tensor([3, 4, 5]), torch.tensor([6])])
    logprobs = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    ref = torch.tensor([-1.5, -1.0, -1.0, -1.0])
    train = TrainSection(gamma=1.0, lam=1.0, kl_estimator="k1", whiten_advantages=False)
    t = step_targets("gae", batch, torch.tensor([1.0, 0.0]), torch.zeros(4), logprobs, ref,
                     torch.tensor([0, 1]), kl_coef=0.1, train=train)
    assert t.kl.tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    # With zero values, gamma = lambda = 1: the return of a token is the sum of its future rewards.
    assert t.returns.tolist() == pytest.approx([1.0 - 0.05, 1.0, 1.0, 0.0])
    assert torch.equal(t.advantages, t.returns)


def test_distillation_targets_alone_and_mixed_with_another_algorithm_s():
    batch = SequenceBatch.from_lists([torch.tensor([5, 6]), torch.tensor([7])], [torch.tensor([8, 9]), torch.tensor([3])])
    student, rollout = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.1, -2.1, -0.6])
    teacher = torch.tensor([-0.5, -3.0, -0.5])
    pure = step_targets("distill", batch, torch.tensor([1.0, 0.0]), torch.zeros(3), student, student,
                        torch.tensor([0, 1]), kl_coef=0.0, train=TrainSection(whiten_advantages=False), teacher=teacher)
    assert pure.advantages.tolist() == pytest.approx([0.5, -1.0, 0.0])  # each token: teacher - student
    # A one-pass update has no recomputed logprobs yet: the student's are the rollout's.
    one_pass = step_targets("distill", batch, torch.tensor([1.0, 0.0]), torch.zeros(3), None, student,
                            torch.tensor([0, 1]), kl_coef=0.0, train=TrainSection(whiten_advantages=False),
                            teacher=teacher, rollout_logprobs=rollout)
    assert one_pass.advantages.tolist() == pytest.approx([0.6, -0.9, 0.1])
    # Mixed: RLOO's advantage (score - the other's: +1, -1) plus 0.5 x the teacher's grade.
    train = TrainSection(whiten_advantages=False, distill_coef=0.5)
    mixed = step_targets("rloo", batch, torch.tensor([1.0, 0.0]), torch.zeros(3), student, student,
                         torch.tensor([0, 0]), kl_coef=0.0, train=train, teacher=teacher)
    assert mixed.advantages.tolist() == pytest.approx([1.25, 0.5, -1.0])


def test_dataset_batches_are_deterministic_and_cover_each_epoch():
    data = PromptDataset.from_config(DataSection(task="addition", size=10), seed=3)
    assert data.batch(2, 4) == PromptDataset.from_config(DataSection(task="addition", size=10), seed=3).batch(2, 4)
    epoch = data.batch(1, 5) + data.batch(2, 5)
    assert sorted(map(id, epoch)) == sorted(map(id, data.records))
    spanning = data.batch(2, 7)  # items 7..13: the end of epoch 0 and the start of epoch 1
    assert spanning[:3] == data.batch(1, 10)[7:] and spanning[3:] == data.batch(2, 10)[:4]


def test_dataset_from_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "q1", "ground_truth": "a1"}\n\n{"prompt": "q2"}\n')
    data = PromptDataset.from_config(DataSection(task=None, path=str(path)), seed=0)
    assert [(r.prompt, r.ground_truth) for r in data.records] == [("q1", "a1"), ("q2", "")]
    path.write_text('{"question": "q1"}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        PromptDataset.from_config(DataSection(task=None, path=str(path)), seed=0)


def test_adaptive_kl_controller_moves_the_coefficient_between_steps(make_config):
    from rolefleet.algos import KL_CONTROLLERS

    cfg = make_config("train.total_steps=3", "train.kl_coef=0.1", "train.kl_controller=adaptive",
                      "train.kl_target=1e-6", "train.kl_horizon=100", "actor.lr=1e-2",
                      "train.kl_estimator=k3")  # k3 >= 0: a k1 mean can come out negative by chance
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor)), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(CriticCore(cfg.critic)))
    logger = RunLogger(cfg.run.out, 3, progress=False)
    asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, 3)))
    logger.close()
    r = logger.records
    assert r[0]["kl_coef"] == 0.1
    for prev, cur in zip(r, r[1:]):
        expected = KL_CONTROLLERS.get("adaptive")(prev["kl_coef"], prev["kl"], 1e-6, 100, 8)
        assert cur["kl_coef"] == pytest.approx(expected)
    # Step 1 samples from a policy equal to the reference: KL 0, below target, so the penalty shrinks.
    assert r[0]["kl"] == 0 and r[1]["kl_coef"] < r[0]["kl_coef"]


def test_a_second_run_against_used_roles_is_refused(make_config):
    from rolefleet.common.errors import FailedPrecondition

    cfg = make_config("train.total_steps=1")
    actor = ActorCore(cfg.actor)
    roles = Roles(InProcessActorClient(actor), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(CriticCore(cfg.critic)))
    for attempt in range(2):
        logger = RunLogger(cfg.run.out, 1, progress=False)
        try:
            if attempt == 0:
                asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, 1)))
            else:
                with pytest.raises(FailedPrecondition, match="already applied steps up to 1"):
                    asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, 1)))
        finally:
            logger.close()
    assert actor.policy_version == 1


def test_critic_warmup_updates_only_the_critic_first(make_config):
    cfg = make_config("train.total_steps=4", "train.critic_warmup_steps=2")
    actor, critic = ActorCore(cfg.actor), CriticCore(cfg.critic)
    roles = Roles(InProcessActorClient(actor), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(critic))
    status, records = run(cfg, roles)
    assert status.state == RunState.FINISHED and critic.model_version == 4
    # The actor applied its own steps 1 and 2 at run steps 3 and 4.
    assert actor.policy_version == 2 and [r["policy_version"] for r in records] == [0, 0, 1, 2]
    assert [r.get("critic_warmup") for r in records] == [1.0, 1.0, None, None]
    assert "actor/loss" not in records[0] and "actor/loss" in records[2]


@pytest.mark.parametrize("overrides, message", [
    (["algorithm=grpo", "train.samples_per_prompt=2"], "has no critic"),
    (["train.total_steps=2"], "leaves no actor step"),
])
def test_critic_warmup_config_errors(make_config, overrides, message):
    from rolefleet.common.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_config("train.critic_warmup_steps=2", *overrides)


def test_a_step_that_compiles_after_warm_up_is_warned_about():
    from rolefleet.coordinator.step_metrics import COMPILE_WARMUP_STEPS, late_compile

    first = {"step": 1, "compile/graphs": 12, "compile/seconds": 40.0}
    assert late_compile(first) is None  # warm-up compiles are expected
    assert late_compile({"step": COMPILE_WARMUP_STEPS + 1, "compile/graphs": 0, "compile/seconds": 0.0}) is None
    warning = late_compile({"step": 17, "compile/graphs": 2, "compile/seconds": 9.9})
    assert warning.startswith("step 17: the trainers compiled 2 graph(s) in 9.9 s after warm-up")

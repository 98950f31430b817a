"""The step body both modes run on a generated rollout batch (DESIGN "One step", after step 1):

2. reward.Score | critic.ComputeValues | actor.ComputeLogProbs, concurrently, for what the batch
   lacks of them; all of it finite
3. advantages and returns (the algorithm's estimator), KL-coefficient update
4. actor.Update | critic.Update, concurrently
5. the step's record, with an evaluation on held-out prompts when due (`evaluation.py`)
6. a checkpoint when due, else a snapshot (written behind the next step; the record is logged
   once it is complete)

Generation is the only phase the modes do differently. Sync mode (`loop.py`) generates a batch and
runs this on it, one step after another. Async mode (`pipeline.py`) generates ahead, streaming each
chunk of samples to the reward and the critic as it comes, and runs this in its train stage; what
it adds around the updates (the exact order's wait, the policy version the generate stage watches,
its `pipeline/*` record entries) comes through a `Schedule`. Role calls are repeated on a transient
failure in both modes (`calls.Retries`), and the coordinator's state (`CoordinatorState`) is saved
and resumed the same way.

Timing (the record's `timing/*_s`, docs/metrics.md): `generate` from the request to the batch's last
sample; `score` the wait for the batch's scores, values and logprobs after its last sample (in
async mode the score stage's wait for the chunks still in flight, plus the train stage's logprobs
pass); `update` the updates' calls; `step` up to the updates' end from the step's start (sync) or
from the previous step's updates' end (async: what the run's throughput is made of).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from rolefleet.actor.types import LogProbs, PolicyTargets, Sample
from rolefleet.algos import KL_CONTROLLERS
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.role_types import UpdateResult
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.calls import Retries, Roles
from rolefleet.coordinator.checkpoints import Checkpointer
from rolefleet.coordinator.checks import require_finite
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.episodes import episode_metrics, with_env_rewards
from rolefleet.coordinator.evaluation import Evaluator
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.rollout import Rollout, score_items
from rolefleet.coordinator.saved_state import CoordinatorState
from rolefleet.coordinator.source import RolloutSource, trains_at
from rolefleet.coordinator.state import RunStatus
from rolefleet.coordinator.step_metrics import distill_metrics, late_compile, step_record
from rolefleet.coordinator.targets import Targets, after_one_pass, shaped_scores, step_targets, truncated
from rolefleet.critic.types import CriticValues
from rolefleet.reward.types import ScoreResult
from rolefleet.teacher.types import TeacherLogProbs

_log = logging.getLogger(__name__)


class Schedule:
    """What a mode adds around a step's updates; the base adds nothing."""

    async def before_update(self, step: int) -> None:
        """What the updates of `step` wait for."""

    async def updated(self, rollout: Rollout, actor: UpdateResult, now: float,
                      seconds: dict[str, float]) -> dict[str, float]:
        """Right after the updates on `rollout` (`now`: their end; `seconds`: the step's timing):
        the record's entries the mode adds."""
        return {}


NOTHING_ADDED = Schedule()


class StepBody:
    """The run's dataset, evaluator, coordinator state and role clients (their calls repeated on
    a transient failure: use `roles`, not the clients given), and the step on them (`run`)."""

    def __init__(self, cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus, clock: BusyClock,
                 checkpointer: Checkpointer, resumed: CoordinatorState | None = None):
        self.cfg, self.logger, self.status, self.clock, self.checkpointer = cfg, logger, status, clock, checkpointer
        # Resumed after checkpoint k: step k's updates were the last; the run goes on with step k + 1.
        self.state = resumed or CoordinatorState(step=0, kl_coef=cfg.train.kl_coef)
        self.saved = self.state.step  # the newest step a checkpoint holds
        self.dataset = PromptDataset.for_run(cfg)
        if self.state.data is not None:  # not in the checkpoint of step 0
            self.dataset.load_state_dict(self.state.data)  # refuses prompts that changed since
        if self.state.carried and not cfg.pipeline.partial_rollouts.enabled:
            # Saved with partial rollouts, resumed without: those groups stay untrained (their data
            # position is behind the run's), and are not saved again.
            print(f"rolefleet: the checkpoint carries {len(self.state.carried)} groups of unfinished responses "
                  "(pipeline.partial_rollouts); without it they are dropped", flush=True)
            self.state.carried = []
        self.evaluator = Evaluator.for_run(cfg, self.dataset)
        # A trainer back as a new process is loaded alone from the snapshot of the run's step (calls.py).
        self.retries = Retries(cfg.pipeline.retries, self.state, cfg.train.critic_warmup_steps,
                               lambda name, step, since: checkpointer.restore_role(getattr(roles, name), name, step,
                                                                                   since),
                               wait_s=cfg.train.connect_timeout_s, stateless_wait_s=cfg.reward.restart_wait_s,
                               stopping=lambda: self.status.stop_requested)
        self.roles = self.retries.wrap(roles)
        self.kl_controller = KL_CONTROLLERS.get(cfg.train.kl_controller)
        self._reward_replicas: dict[str, str] = {}  # label -> reward version, as last said
        # What every step trains on, in both modes (`source.py`); the actor holds the policy the
        # last step trained (its version a step behind the run's next step).
        self.source = RolloutSource(cfg, self.roles.actor, self.roles.reward, self.dataset,
                                    lambda: trains_at(cfg, self.state.step + 1))

    def eval_generate(self):
        """What evaluation generates with: whole episodes of the held-out records through the
        source's episode stage (the evaluator's prompts are its records' prompts, in order)."""
        records = self.evaluator.records if self.evaluator is not None else []

        async def episodes(prompts, sampling, first_group_id=0):
            return await self.source.stage.generate(records, sampling, first_group_id)

        return episodes

    async def evaluate_start(self) -> None:
        """0. The starting policy on the held-out prompts, as the record of step 0 (not resumed)."""
        if self.evaluator is not None and self.state.step == 0:
            await self.evaluator.before_training(self.logger, self.status, self.eval_generate(),
                                                 self.roles.reward.score)

    async def run(self, step: int, rollout: Rollout, since: float, schedule: Schedule = NOTHING_ADDED) -> dict:
        """Steps 2-6 of `step` on `rollout`; `since`: when the step's time (`timing/step_s`) began.
        The step's record."""
        t, samples, batch = self.cfg.train, rollout.samples, rollout.batch
        warming = step <= t.critic_warmup_steps  # the critic's warm-up: the actor makes no update
        one_pass = self.cfg.one_pass_update and not warming

        # 2. Scores, values and logprobs at once: the three roles do not wait on each other.
        start = time.perf_counter()
        scorers = await self._reward_replicas_now()
        reward, critic_values, logprobs, teacher = await self._scored(rollout, one_pass)
        reward = with_env_rewards(reward, samples)  # multi-turn: what the environment rewarded
        score_s = rollout.score_s + time.perf_counter() - start
        values = critic_values.values if critic_values else torch.zeros(batch.num_response_tokens)

        # 3. Advantages and returns; the KL controller sees this step's KL.
        with self.clock.span("train computes targets"):
            require_finite(samples, reward.total, values, logprobs, self.cfg.reward.function)
            scores, trained, shaping = shaped_scores(t, self.cfg.episode_cap, batch, reward.total,
                                                     truncated(samples))
            # Distilling without the policy's recomputed logprobs (a one-pass update): the rollout's.
            rollout_logprobs = torch.cat([smp.logprobs for smp in samples]) \
                if teacher is not None and logprobs.logprobs is None else None
            targets = step_targets(self.cfg.preset.estimator, batch, scores, values, logprobs.logprobs,
                                   logprobs.ref_logprobs, group_ids(samples), self.state.kl_coef, t,
                                   teacher=teacher.logprobs if teacher is not None else None,
                                   rollout_logprobs=rollout_logprobs)
            policy_targets = policy_targets_for(self.cfg, targets, logprobs, samples, teacher)
        kl_coef = self.state.kl_coef
        own = batch.packed_train_mask()  # multi-turn: the model's tokens (observations have no KL)
        self.state.kl_coef = self.kl_controller(kl_coef, targets.kl[own].mean().item(), t.kl_target, t.kl_horizon,
                                                len(samples))

        # 4. Policy and value updates at once, after the previous step's snapshot is complete (it
        #    was written during this step's generation): the newest one is never more than a step
        #    behind, and a trainer lost while writing it is met here, before its state moves on.
        await self.checkpointer.settle()
        await schedule.before_update(step)
        start = time.perf_counter()
        actor_result, critic_result = await self._updates(step, rollout, batch.with_rows_trained(trained),
                                                          policy_targets, targets, critic_values, warming)
        update_s = time.perf_counter() - start
        if one_pass:
            logprobs, targets = after_one_pass(t, logprobs, targets, actor_result)
        self.checkpointer.trained(step, samples, actor_result.model_version)
        self.state.step = step
        now = time.perf_counter()
        seconds = {"generate": rollout.generate_s, "score": score_s, "update": update_s, "step": now - since}
        added = await schedule.updated(rollout, actor_result, now, seconds)

        # 5. The record, with an evaluation when due (after the step's time: no part of a training step).
        record = step_record(step, actor_result, critic_result, batch, samples, reward, values, logprobs, targets,
                             seconds)
        record["kl_coef"] = kl_coef
        if teacher is not None:
            record.update(distill_metrics(batch, logprobs.logprobs, samples, teacher))
        if (warning := late_compile(record)) is not None:
            _log.warning(warning)
        if self.source.stage.multi_turn:
            record.update(episode_metrics(samples))
            record["timing/env_s"] = rollout.env_s
        record.update(shaping, **rollout.stats)
        if warming:
            record["critic_warmup"] = 1.0
        if step == 1:
            record.update(self.dataset.stats)  # what the load kept, filtered and truncated
        record.update(added, **self.checkpointer.take_recovery())
        record["reward/versions"] = await self._reward_versions(step, scorers)
        if self.evaluator is not None and self.evaluator.due(step):
            # Async mode: in the train stage, so the next update waits for it, while generation goes
            # on within the bound and takes the rollout engine in turns with it (evaluation.py).
            record.update(await self.evaluator.run(step, self.eval_generate(), self.roles.reward.score))
        record.update(self.clock.fractions())

        # 6. The step kept, then its record: a checkpoint when due, else a snapshot (what a lost
        #    trainer resumes from), which holds the run up only while the trainers copy their state
        #    off the device: its files are written behind the next step, and the record is logged
        #    once they are complete. A recorded step is never trained again, nor a kept one unrecorded.
        self.checkpointer.suggest_every(seconds["step"])

        def log(kept: dict[str, float]) -> None:
            record.update(kept)
            self.logger.log(record)
            self.status.record_step(record, actor_result.model_version)

        if await self.checkpointer.keep(self.roles, step, lambda: self._saved_state(record), self._actor_step, log):
            self.saved = step
        return record

    async def _scored(self, rollout: Rollout,
                      one_pass: bool) -> tuple[ScoreResult, CriticValues | None, LogProbs, torch.Tensor | None]:
        """The rollout's scores, values, logprobs and (distilling) the teacher's logprobs: those it
        came with, the others asked for now. A one-pass update takes the policy's logprobs from its
        own forward, so only the reference's are asked for then (during the critic's warm-up the
        actor makes no forward: its come from here)."""
        r, roles = rollout, self.roles
        return await asyncio.gather(
            roles.reward.score(score_items(r.records, r.samples)) if r.reward is None else _given(r.reward),
            roles.critic.compute_values(r.batch) if roles.critic and r.values is None else _given(r.values),
            # Reference logprobs every step, even with no KL term: the `kl` metric watches the drift.
            # (Async mode asks for the reference's alone ahead of a one-pass update; a step of the
            # critic's warm-up needs the policy's too.)
            roles.actor.compute_logprobs(r.batch, self.cfg.sampling.temperature, include_reference=True,
                                         reference_only=one_pass)
            if r.logprobs is None or (not one_pass and r.logprobs.logprobs is None) else _given(r.logprobs),
            roles.teacher.compute_logprobs(r.batch, self.cfg.sampling.temperature, self.cfg.teacher.top_k)
            if roles.teacher else _given(None),
        )

    async def _updates(self, step: int, rollout: Rollout, policy_batch: SequenceBatch, policy: PolicyTargets,
                       targets: Targets, values: CriticValues | None,
                       warming: bool) -> tuple[UpdateResult, UpdateResult | None]:
        """actor.Update | critic.Update. During the critic's warm-up the policy waits, and the actor
        numbers its own steps from the first one it applies. `Update` carries the version of the
        batch's oldest sample (sync mode: its only one), which the actor checks against its bound;
        the critic's, the version that computed the values (its fence). `policy_batch`: the rollout's
        batch with what the policy must not learn from out of its loss mask (`train.overlong: filter`);
        the critic fits every response."""
        warmup, r = self.cfg.train.critic_warmup_steps, rollout
        return await asyncio.gather(
            _given(UpdateResult(step=step, model_version=r.oldest_version, stats={})) if warming else
            self.roles.actor.update(step - warmup, r.oldest_version, policy_batch, policy, self.cfg.sampling.temperature),
            self.roles.critic.update(step, r.batch, targets.returns, values.values, values.model_version)
            if self.roles.critic else _given(None),
        )

    async def save(self) -> None:
        """A checkpoint after the last step: the data of its batches (and of dropped ones) is used."""
        s = self._saved_state()
        await self.checkpointer.save(self.roles, s, self._actor_step(s))
        self.saved = s.step

    async def _reward_replicas_now(self) -> dict[str, str]:
        """The reward replicas in use, by label, with their versions (`reward/definition.py`)."""
        reward = self.roles.reward
        return await reward.versions() if hasattr(reward, "versions") else \
            {"reward": (await reward.status()).weights_digest}

    async def _reward_versions(self, step: int, scorers: dict[str, str]) -> str:
        """The reward definitions of the replicas in use from the step's scoring to its record
        (`scorers`: those at its start), comma-separated: one, or two while a rolling update swaps
        replicas; a change is said on the console."""
        now = await self._reward_replicas_now()
        if now and now != self._reward_replicas:  # none answering (restarting): said once back
            print(f"rolefleet: step {step}: reward replicas and versions: "
                  + ", ".join(f"{label} {v}" for label, v in sorted(now.items())), flush=True)
            self._reward_replicas = now
        return ",".join(sorted({*scorers.values(), *now.values()}))

    def _actor_step(self, s: CoordinatorState) -> int:
        """The actor's own step id at the run's step (behind it during the critic's warm-up)."""
        return max(0, s.step - self.cfg.train.critic_warmup_steps)

    def _saved_state(self, record: dict | None = None) -> CoordinatorState:
        s = self.state
        s.record = record  # the step's (None: the last step's, logged already)
        self.dataset.position = s.batches_used * self.cfg.train.prompts_per_step
        s.data = self.dataset.state_dict()
        s.carried = self.source.saved(s.batches_used)
        return s

    async def finish(self) -> None:
        """After the last step: its snapshot complete (its record logged); if the run was stopped, a
        checkpoint of it (`checkpoint.at_end`): it can resume."""
        await self.checkpointer.settle()
        if self.status.stop_requested and self.state.step > self.saved and self.cfg.checkpoint.at_end:
            await self.save()


def group_ids(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([smp.group_id for smp in samples])


def policy_targets_for(cfg: RoleFleetConfig, targets: Targets, logprobs: LogProbs, samples: list[Sample],
                       teacher: TeacherLogProbs | None = None) -> PolicyTargets:
    """What the actor's update needs; reference and rollout logprobs, and the teacher's most likely
    tokens, travel only when its loss uses them."""
    a = cfg.actor
    return PolicyTargets(
        advantages=targets.advantages,
        old_logprobs=logprobs.logprobs,
        ref_logprobs=logprobs.ref_logprobs if a.kl_loss_coef > 0 else None,
        rollout_logprobs=torch.cat([smp.logprobs for smp in samples]) if a.is_correction != "none" else None,
        teacher_top=teacher.top if teacher is not None and a.teacher_kl_coef > 0 else None,
    )


async def _given(value):
    return value

"""Checkpoints and resume against in-process roles: a run stopped after 3 steps and resumed by new
roles ends with the weights, data order and metrics of a run of 6 steps straight; an interrupted
checkpoint is never loaded; async runs resume too."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.coordinator.journal import Journal
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore
from rolefleet.trainer.checkpoint import MANIFEST, complete_checkpoints

pytestmark = pytest.mark.timeout(240)


def run(cfg, stop_after: int | None = None):
    """A run on fresh roles (as new processes would be); stopped after `stop_after` updates."""
    status = RunStatus(cfg.run.name, cfg.train.total_steps)

    class Actor(InProcessActorClient):
        async def update(self, *args):
            result = await super().update(*args)
            if result.model_version == stop_after:
                status.request_stop()
            return result

    actor = ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)
    critic = CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound) if cfg.preset.uses_critic else None
    roles = Roles(Actor(actor), InProcessRewardClient(RewardCore(cfg.reward)),
                  InProcessCriticClient(critic) if critic else None)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False, resume=cfg.run.resume)
    asyncio.run(train(cfg, roles, logger, status))
    logger.close()
    return status, actor, critic


def metrics(cfg):
    return [json.loads(line) for line in (cfg.run.out / "metrics.jsonl").read_text().splitlines()]


def journal_ids(cfg) -> list[int]:
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        return journal.trained_sample_ids()


def same_step(a: dict, b: dict) -> bool:
    keys = ("reward/mean", "actor/loss", "critic/vf_loss", "kl", "kl_coef", "policy_version")
    return all(a.get(k) == b.get(k) for k in keys)


def test_stop_after_three_and_resume_equals_six_steps_straight(make_config, tmp_path):
    common = ("algorithm=ppo", "train.total_steps=6", "checkpoint.every=3", "train.samples_per_prompt=2",
              "train.kl_controller=adaptive", "train.kl_coef=0.05")
    straight_cfg = make_config(*common, f"run.output_dir={tmp_path / 'straight'}")
    _, straight_actor, straight_critic = run(straight_cfg)

    cfg = make_config(*common, f"run.output_dir={tmp_path / 'resumed'}")
    status, _, _ = run(cfg, stop_after=3)
    assert status.state == RunState.STOPPED and status.step == 3
    # Step 0's: what a role lost before the first checkpoint would be recovered to (run.max_restarts).
    assert [s for s, _ in complete_checkpoints(cfg.run.out / "checkpoints")] == [0, 3]

    resumed_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})})
    status, actor, critic = run(resumed_cfg)
    assert status.state == RunState.FINISHED and status.step == 6
    assert actor.digest() == straight_actor.digest() and critic.digest() == straight_critic.digest()
    assert actor.policy_version == 6 and actor.ledger.last_step == 6
    records, expected = metrics(cfg), metrics(straight_cfg)
    assert [r["step"] for r in records] == list(range(1, 7))  # steps 1-3 kept, 4-6 appended, none twice
    assert all(same_step(a, b) for a, b in zip(records, expected)), (records[3], expected[3])
    assert [s for s, _ in complete_checkpoints(cfg.run.out / "checkpoints")] == [0, 3, 6]
    # The journal: every sample of the six steps trained once, the same ones as straight through.
    ids = journal_ids(cfg)
    assert ids == journal_ids(straight_cfg) and len(ids) == len(set(ids)) == 6 * cfg.train.prompts_per_step * 2


@pytest.mark.parametrize("kept_by", ["checkpoint", "snapshot"])
def test_a_step_kept_but_not_yet_recorded_when_the_run_ended_gets_its_record_on_resume(make_config, tmp_path,
                                                                                      kept_by):
    """A step's checkpoint (or snapshot) is complete before its record is logged: a coordinator
    killed in between leaves a run that resumes after the step without its record. The record
    travels in the checkpoint's coordinator state and is logged on resume, once."""
    keep = (["checkpoint.every=3"] if kept_by == "checkpoint"
            else ["checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.snapshot.enabled=true",
                  f"checkpoint.snapshot.dir={tmp_path / 'shm'}"])
    cfg = make_config("algorithm=grpo", "train.total_steps=5", "train.samples_per_prompt=2", *keep,
                      f"run.output_dir={tmp_path / 'run'}")
    run(cfg, stop_after=3)
    records = metrics(cfg)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Killed after step 3 was kept and before its record reached the file.
    path = cfg.run.out / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    resumed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})})
    status, _, _ = run(resumed)
    assert status.state == RunState.FINISHED and status.step == 5
    again = metrics(cfg)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5]
    assert same_step(again[2], records[2]) and again[2]["reward/mean"] == records[2]["reward/mean"]


def test_an_interrupted_checkpoint_is_never_loaded(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.total_steps=4", "checkpoint.every=2", "train.samples_per_prompt=2")
    run(cfg)
    root = cfg.run.out / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [0, 2, 4]
    (root / "step-00000004" / MANIFEST).unlink()  # killed before the manifest was written
    shutil.rmtree(root / "step-00000004" / "actor")
    (root / "step-00000004" / "actor.partial").mkdir()  # ... while the actor was writing
    resumed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})})
    status, actor, _ = run(resumed)
    assert status.step == 4 and actor.policy_version == 4
    assert [r["step"] for r in metrics(cfg)] == [1, 2, 3, 4]
    assert [s for s, _ in complete_checkpoints(root)] == [0, 2, 4]  # the new step 4 replaced the broken one


def test_an_async_run_resumes_after_its_last_checkpoint(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=5",
                      "checkpoint.every=2", "train.samples_per_prompt=2")
    status, _, _ = run(cfg, stop_after=3)
    assert status.state == RunState.STOPPED and status.step == 3
    # The stop saved step 3 too: nothing done is lost.
    assert [s for s, _ in complete_checkpoints(cfg.run.out / "checkpoints")] == [0, 2, 3]
    resumed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})})
    status, actor, _ = run(resumed)
    assert status.state == RunState.FINISHED and actor.policy_version == 5
    assert [r["step"] for r in metrics(cfg)] == [1, 2, 3, 4, 5]
    ids = journal_ids(cfg)  # step 3's samples were trained before the stop and never again
    assert len(ids) == len(set(ids)) == 5 * cfg.train.prompts_per_step * 2


def test_resume_without_a_checkpoint_starts_from_step_one(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.total_steps=2", "run.resume=true", "train.samples_per_prompt=2")
    status, actor, _ = run(cfg)
    assert status.step == 2 and actor.policy_version == 2


def fresh_critic(cfg) -> CriticCore:
    """A critic as a started (or restarted) process has it: its initial weights."""
    return CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound)


def run_with_critic(cfg, critic_client):
    """The run in-process on fresh roles, the critic reached through `critic_client` (a client class
    that may play the critic's death); (status, actor core, roles) once it ended."""
    status = RunStatus(cfg.run.name, cfg.train.total_steps)
    actor = ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)
    roles = Roles(InProcessActorClient(actor), InProcessRewardClient(RewardCore(cfg.reward)),
                  critic_client(fresh_critic(cfg)))
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    asyncio.run(train(cfg, roles, logger, status))
    logger.close()
    return status, actor, roles


def count_prompts_generated(monkeypatch) -> list[int]:
    """The prompts the actor is asked to generate for, call by call (the in-process client's)."""
    asked: list[int] = []
    generate, stream = InProcessActorClient.generate, InProcessActorClient.generate_stream

    async def counted(self, prompts, *args, **kwargs):
        asked.append(len(prompts))
        return await generate(self, prompts, *args, **kwargs)

    async def counted_stream(self, prompts, *args, **kwargs):
        asked.append(len(prompts))
        async for chunk in stream(self, prompts, *args, **kwargs):
            yield chunk

    monkeypatch.setattr(InProcessActorClient, "generate", counted)
    monkeypatch.setattr(InProcessActorClient, "generate_stream", counted_stream)
    return asked


@pytest.mark.parametrize("mode, snapshots", [("sync", True), ("sync", False), ("async", True)])
def test_a_lost_role_is_recovered_from_the_newest_snapshot_or_checkpoint(make_config, tmp_path, capsys, monkeypatch,
                                                                          mode, snapshots):
    """The critic's process 'dies' in its update of step 4 and comes back fresh (its initial
    weights). With snapshots it is loaded alone from the snapshot of step 3 and its update repeated:
    the actor's rollouts of step 4 (async mode: the batches it generated meanwhile) are kept, no
    step is trained or generated again. Without, the run goes back to checkpoint 2 and trains step 3
    again. Either way it ends as a run without a loss would (sync mode: to the bit), every sample
    trained once."""
    from rolefleet.common.errors import Unavailable

    common = ("algorithm=ppo", "train.total_steps=6", "checkpoint.every=2", "train.samples_per_prompt=2",
              f"pipeline.mode={mode}", "pipeline.max_staleness=1",
              f"checkpoint.snapshot.enabled={str(snapshots).lower()}", f"checkpoint.snapshot.dir={tmp_path / 'shm'}")
    straight_cfg = make_config(*common, f"run.output_dir={tmp_path / 'straight'}")
    asked = count_prompts_generated(monkeypatch)
    _, straight_actor, straight_critic = run(straight_cfg)
    straight_asked, asked[:] = list(asked), []

    cfg = make_config(*common, f"run.output_dir={tmp_path / 'lost'}")

    class DyingCritic(InProcessCriticClient):
        died = False

        async def update(self, step, *args):
            if step == 4 and not self.died:
                DyingCritic.died = True
                self.core = fresh_critic(cfg)  # the restarted process
                raise Unavailable("critic: connection refused")
            return await super().update(step, *args)

    capsys.readouterr()
    status, actor, roles = run_with_critic(cfg, DyingCritic)
    assert status.state == RunState.FINISHED and DyingCritic.died
    if mode == "sync":  # (async: which critic version computes a batch's values within the bound is timing's)
        assert actor.digest() == straight_actor.digest() and roles.critic.core.digest() == straight_critic.digest()
    assert [r["step"] for r in metrics(cfg)] == list(range(1, 7))
    ids = journal_ids(cfg)
    assert ids == journal_ids(straight_cfg) and len(ids) == len(set(ids))
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        # Without snapshots step 3 was trained twice (in the log only: the journal keeps it once).
        assert [step for step, _ in journal.rewound()] == ([] if snapshots else [3])
    [after] = [r for r in metrics(cfg) if "recovery/steps_lost" in r]
    assert (after["step"], after["recovery/steps_lost"]) == ((4, 0) if snapshots else (3, 1))
    said = capsys.readouterr().out
    assert ("the critic came back as a new process; loaded alone from" in said) == snapshots
    assert ("resuming from the newest snapshot or checkpoint" in said) == (not snapshots)
    # The actor's generations: those of the run without a loss (it never went back), or more.
    assert (asked == straight_asked) == snapshots, (asked, straight_asked)
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").iterdir())  # a finished run's are gone


def test_a_stop_ends_the_recovery_s_wait_for_a_role_that_does_not_come_back(make_config, tmp_path):
    """The critic dies for good in step 2; the run, recovering, waits for it up to
    train.connect_timeout_s. A stop asked meanwhile (SIGTERM) ends that wait at once: the run fails
    naming the stop, not after the whole wait (which `up`, compose or Kubernetes would cut with a kill)."""
    import time

    from rolefleet.common.errors import Unavailable

    cfg = make_config("algorithm=ppo", "train.total_steps=4", "checkpoint.every=1", "pipeline.retries=0",
                      "train.connect_timeout_s=120", f"checkpoint.snapshot.dir={tmp_path / 'shm'}")
    status = RunStatus(cfg.run.name, cfg.train.total_steps)

    class GoneCritic(InProcessCriticClient):
        dead, asked = False, 0

        async def update(self, step, *args):
            if step == 2:
                GoneCritic.dead = True
            if GoneCritic.dead:
                raise Unavailable("critic: connection refused")
            return await super().update(step, *args)

        async def status(self, *args, **kwargs):
            if not GoneCritic.dead:
                return await super().status(*args, **kwargs)
            GoneCritic.asked += 1
            if GoneCritic.asked == 3:  # the recovery has been waiting a while: SIGTERM arrives
                status.request_stop()
            raise Unavailable("critic: connection refused")

    roles = Roles(InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)),
                  InProcessRewardClient(RewardCore(cfg.reward)), GoneCritic(fresh_critic(cfg)))
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    start = time.monotonic()
    with pytest.raises(Unavailable, match="asked to stop while waiting for the critic"):
        asyncio.run(train(cfg, roles, logger, status))
    logger.close()
    assert GoneCritic.asked == 3 and time.monotonic() - start < 60  # a poll after the stop, not 120 s


def test_a_trainer_lost_while_writing_a_snapshot_resumes_from_the_complete_one_before(make_config, tmp_path):
    """The critic dies halfway through its part of the snapshot of step 3 (its directory left
    `.partial`, no manifest): the run goes back to the snapshot of step 2, the newest complete one,
    trains step 3 again, and ends as a run without a loss would."""
    from rolefleet.common.errors import Unavailable

    common = ("algorithm=ppo", "train.total_steps=5", "train.samples_per_prompt=2",
              "checkpoint.every_minutes=0", f"checkpoint.snapshot.dir={tmp_path / 'shm'}")
    straight_cfg = make_config(*common, f"run.output_dir={tmp_path / 'straight'}")
    _, straight_actor, straight_critic = run(straight_cfg)
    cfg = make_config(*common, f"run.output_dir={tmp_path / 'lost'}")

    class CriticDyingInASnapshot(InProcessCriticClient):
        died_in = None

        async def save_checkpoint(self, step, path, background=False):
            # The snapshot's state was staged (the step went on), its files are being written:
            # the coordinator's wait for them meets a critic that died meanwhile.
            if step == 3 and not background and CriticDyingInASnapshot.died_in is None:
                CriticDyingInASnapshot.died_in = path
                await super().save_checkpoint(step, path)  # (its write over, undone below: a deterministic test)
                shutil.rmtree(path)
                Path(path).with_name("critic.partial").mkdir(parents=True)  # what it had written
                self.core = fresh_critic(cfg)  # restarted
                raise Unavailable("critic: connection refused")
            return await super().save_checkpoint(step, path, background)

    status, actor, roles = run_with_critic(cfg, CriticDyingInASnapshot)
    assert status.state == RunState.FINISHED
    assert CriticDyingInASnapshot.died_in.startswith(str(tmp_path / "shm"))  # a snapshot's write, not a checkpoint's
    assert actor.digest() == straight_actor.digest() and roles.critic.core.digest() == straight_critic.digest()
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        assert [step for step, _ in journal.rewound()] == [3]
    # Step 3 was lost in flight (its record not yet written): no finished step was trained again.
    [after] = [r for r in metrics(cfg) if "recovery/steps_lost" in r]
    assert (after["step"], after["recovery/steps_lost"]) == (3, 0)
    # Every step but the last (a checkpoint at the end instead) took its snapshot.
    assert [r["step"] for r in metrics(cfg) if r.get("checkpoint/snapshot_s", 0) > 0] == [1, 2, 3, 4]


def test_a_new_run_moves_an_earlier_runs_checkpoints_aside(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.total_steps=4", "checkpoint.every=2", "train.samples_per_prompt=2")
    run(cfg)
    again = cfg.model_copy(update={"train": cfg.train.model_copy(update={"total_steps": 2})})
    run(again)  # a new run in the same directory: its checkpoints only
    assert [s for s, _ in complete_checkpoints(cfg.run.out / "checkpoints")] == [0, 2]
    [aside] = cfg.run.out.glob("checkpoints.replaced-*")
    assert [s for s, _ in complete_checkpoints(aside)] == [0, 2, 4]  # kept, not deleted
    resumed = again.model_copy(update={"run": again.run.model_copy(update={"resume": True})})
    status, actor, _ = run(resumed)  # the new run's step 2, not the earlier run's step 4
    assert status.step == 2 and actor.policy_version == 2


def test_bad_checkpoint_requests_are_refused_and_change_nothing(make_config, tmp_path):
    from rolefleet.common.errors import FailedPrecondition, InvalidArgument

    cfg = make_config("algorithm=ppo")
    critic = CriticCore(cfg.critic, cfg.run.seed)
    digest = critic.digest()
    with pytest.raises(FailedPrecondition, match="a checkpoint of step 5 was asked for; the critic's last applied "
                                                 "step is 0"):
        critic.save_checkpoint(5, str(tmp_path / "critic"))
    assert not (tmp_path / "critic").exists() and not (tmp_path / "critic.partial").exists()
    with pytest.raises(InvalidArgument, match="path: no checkpoint directory given"):
        critic.save_checkpoint(0, "")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match=r"path: no critic checkpoint at .*empty \(role.json missing"):
        critic.load_checkpoint(str(tmp_path / "empty"))
    assert critic.digest() == digest and critic.status().broken == "" and critic.state.version == 0


def test_checkpoint_paths_stay_under_the_runs_checkpoint_directory(make_config, tmp_path):
    """A served role reads and writes checkpoints only under checkpoint.dir: a request naming any
    other directory (absolute, or `..` out of it) is refused and nothing there is touched; a
    trainer.pt that would run code when unpickled is refused without running it."""
    from rolefleet.common.errors import FailedPrecondition, InvalidArgument

    cfg = make_config("algorithm=ppo")
    critic = CriticCore(cfg.critic, cfg.run.seed)
    root = tmp_path / "checkpoints"
    critic.checkpoint_root = root
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "data.txt").write_text("keep me")
    for path in (str(victim), str(root / ".." / "precious"), "/etc", "relative/dir"):
        with pytest.raises(InvalidArgument, match="outside the run's checkpoint directory"):
            critic.save_checkpoint(0, path)
        with pytest.raises(InvalidArgument, match="outside the run's checkpoint directory"):
            critic.load_checkpoint(path)
    with pytest.raises(InvalidArgument, match="path: has a NUL character"):
        critic.save_checkpoint(0, str(root / "a\x00b"))
    assert (victim / "data.txt").read_text() == "keep me" and sorted(p.name for p in victim.iterdir()) == ["data.txt"]
    assert critic.save_checkpoint(0, str(root / "step-0" / "critic")).step == 0  # inside: fine

    # A planted trainer.pt whose unpickling would run code: refused, the code never runs.
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import torch

    torch.save({"scheduler": Exploit()}, root / "step-0" / "critic" / "trainer.pt")
    with pytest.raises(FailedPrecondition, match="loading the checkpoint"):
        critic.load_checkpoint(str(root / "step-0" / "critic"))
    assert not marker.exists()


def test_a_checkpoint_is_due_every_so_many_minutes_of_training(make_config, monkeypatch):
    from rolefleet.coordinator import checkpoints as module
    from rolefleet.coordinator.checkpoints import Checkpointer

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    checkpointer = Checkpointer(make_config("checkpoint.every_minutes=10", "checkpoint.at_end=false",
                                            "train.total_steps=100"))
    assert not checkpointer.due(3)
    now[0] += 599
    assert not checkpointer.due(4)
    now[0] += 1
    assert checkpointer.due(5)  # ten minutes since the run started
    checkpointer.last_saved = now[0]  # as `save` sets it
    assert not checkpointer.due(6)
    off = Checkpointer(make_config("checkpoint.every_minutes=0", "checkpoint.at_end=false", "train.total_steps=100"))
    now[0] += 10_000
    assert not off.due(7) and not off.cfg.checkpoint.periodic


def test_a_run_with_partial_rollouts_resumes_its_carried_responses(make_config, tmp_path):
    """The responses carried past a checkpoint are in it (`coordinator.json`): a run stopped there
    and resumed generates them on from where they were, the same run as one straight through."""
    common = ("algorithm=grpo", "train.total_steps=6", "checkpoint.every=3", "train.samples_per_prompt=2",
              "pipeline.partial_rollouts.enabled=true", "pipeline.partial_rollouts.token_budget=1",
              "pipeline.max_staleness=3")
    straight_cfg = make_config(*common, f"run.output_dir={tmp_path / 'straight'}")
    _, straight_actor, _ = run(straight_cfg)
    cfg = make_config(*common, f"run.output_dir={tmp_path / 'resumed'}")
    run(cfg, stop_after=3)
    saved = json.loads((cfg.run.out / "checkpoints" / "step-00000003" / "coordinator.json").read_text())
    assert saved.get("carried")  # the test is about them: some responses were open at step 3
    resumed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})})
    status, actor, _ = run(resumed)
    assert status.state == RunState.FINISHED and actor.digest() == straight_actor.digest()
    ids = journal_ids(cfg)
    assert ids == journal_ids(straight_cfg) and len(ids) == len(set(ids))
    assert all(same_step(a, b) for a, b in zip(metrics(cfg), metrics(straight_cfg)))


def test_without_snapshots_the_run_suggests_a_checkpoint_interval_from_what_a_save_took(make_config, tmp_path,
                                                                                        capsys):
    common = ("algorithm=grpo", "train.total_steps=3", "train.samples_per_prompt=2")
    run(make_config(*common, "checkpoint.snapshot.enabled=false", f"run.output_dir={tmp_path / 'off'}"))
    [said] = [line for line in capsys.readouterr().out.splitlines() if "checkpoint.every=" in line]
    assert said.startswith("rolefleet: snapshots are off, so a lost actor or critic goes back to the newest "
                           "checkpoint; a checkpoint took ")
    every = int(said.split("checkpoint.every=")[1].split()[0])
    assert every >= 1 and f"bound that loss to {every} steps at about 3% of the run's time" in said
    for kept in (("checkpoint.snapshot.enabled=true",), ("checkpoint.snapshot.enabled=false", "checkpoint.every=2")):
        run(make_config(*common, *kept, f"run.output_dir={tmp_path / kept[-1]}"))
        assert "checkpoint.every=" not in capsys.readouterr().out  # snapshots on, or the interval chosen


def test_a_snapshot_asked_for_while_the_previous_ones_completion_fails_is_skipped_not_a_crash(make_config, tmp_path):
    """A step that does not wait for the previous snapshot's completion before its own (SFT's: its
    update changes nothing a snapshot still reads) may ask for the next snapshot while that
    completion fails, which turns snapshots off: the step is recorded without one."""
    from rolefleet.coordinator.checkpoints import Checkpointer

    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", f"checkpoint.snapshot.dir={tmp_path / 'shm'}")
    checkpointer = Checkpointer(cfg)
    logged = []

    async def scenario():
        async def failing_completion():
            await asyncio.sleep(0.05)
            checkpointer._snapshots_off(2, OSError(28, "No space left on device"))

        checkpointer._pending = asyncio.create_task(failing_completion())
        await checkpointer.snapshot(roles=None, state=None, actor_step=3, then=logged.append)

    asyncio.run(scenario())
    assert logged == [{}] and checkpointer.snapshots is None

"""`kill -9` of each role in turn under `rolefleet up`: every role is restarted, a lost trainer is
loaded alone from the snapshot of the run's step or the run recovers from its newest snapshot or
checkpoint (a lost reward's call is repeated instead), and the run finishes all its steps; the journal shows every sample
trained exactly once in the final record, and what each recovery redid."""

import os
import random
import signal
import time

import pytest

from rolefleet.coordinator.journal import Journal
from rolefleet.trainer.checkpoint import complete_checkpoints
from tests.conftest import tiny_config
from tests.e2e.procs import processes_mentioning, read_metrics, rolefleet, write_config

pytestmark = [pytest.mark.timeout(420), pytest.mark.e2e]


def last_step(metrics) -> int:
    try:
        records = read_metrics(metrics)
    except (OSError, ValueError):
        return 0
    return records[-1]["step"] if records else 0


def wait_for_step(proc, metrics, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while last_step(metrics) < step:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s:.0f} s"
        time.sleep(0.1)


def kill_9(role: str, resolved: str) -> None:
    """`kill -9` of the process serving `role` for the run whose resolved config is `resolved`."""
    [pid] = [p for p in processes_mentioning(f"serve {role}") if p in processes_mentioning(resolved)]
    os.kill(pid, signal.SIGKILL)


def test_a_run_survives_kill_9_of_each_role_in_turn(make_config, tmp_path):
    total = 36  # the four kills come by about step 20 (each 2-4 steps after the last recovery)
    cfg = make_config("algorithm=ppo", f"train.total_steps={total}", "checkpoint.every=3", "checkpoint.keep=2",
                      "train.samples_per_prompt=2", "run.max_restarts=2", "data.size=512")
    config = write_config(cfg, tmp_path / "config.yaml")
    resolved = str(cfg.run.out / "config.yaml")
    metrics = cfg.run.out / "metrics.jsonl"
    rng = random.Random(7)
    proc = rolefleet("up", str(config))
    try:
        reached = 0
        for role in ("actor", "critic", "reward", "coordinator"):
            reached = max(reached, last_step(metrics)) + rng.randint(2, 4)  # a random point after the last recovery
            wait_for_step(proc, metrics, reached)
            kill_9(role, resolved)
            assert last_step(metrics) < total, "the run ended before every role was killed: give it more steps"
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert f"run {cfg.run.name} ended FINISHED after step {total}/{total}" in output
    for role in ("actor", "critic", "reward", "coordinator"):
        assert f"rolefleet: {role} exited with code -9 during the run; restarting it" in output
    # Actor and critic were recovered from in the run (loaded alone, or the run recovered).
    assert output.count("recovery 1 of 2") + output.count("came back as a new process; loaded alone") >= 2
    assert "the reward holds no training state" in output  # its lost call was repeated instead
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, total + 1))
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
        assert len(ids) == len(set(ids)) == total * cfg.train.prompts_per_step * 2  # none lost, none twice
        assert journal.starts() == 2  # the coordinator: started, killed, resumed
    # Each trainer's loss cost at most the step in flight: the run went back to the snapshot of the
    # step before it (the coordinator's own restart too), never to an older checkpoint.
    lost = [r["recovery/steps_lost"] for r in read_metrics(metrics) if "recovery/steps_lost" in r]
    assert len(lost) >= 2 and all(n == 0 for n in lost), lost
    assert processes_mentioning(resolved) == []


def kill_once(cfg, tmp_path, role: str, at_step: int) -> tuple[str, list[dict]]:
    """`rolefleet up` of `cfg`, `kill -9` of `role` once step `at_step` is logged; the run's output
    and records once it ended (it must end with code 0)."""
    config = write_config(cfg, tmp_path / "config.yaml")
    resolved = str(cfg.run.out / "config.yaml")
    metrics = cfg.run.out / "metrics.jsonl"
    proc = rolefleet("up", str(config))
    try:
        wait_for_step(proc, metrics, at_step)
        kill_9(role, resolved)
        assert last_step(metrics) < cfg.train.total_steps, "the run ended before the kill: give it more steps"
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert f"run {cfg.run.name} ended FINISHED after step {cfg.train.total_steps}/{cfg.train.total_steps}" in output
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, cfg.train.total_steps + 1))
    return output, records


def trained_once(cfg, journal: Journal) -> None:
    """Every sample of the run was trained on, none twice."""
    ids = journal.trained_sample_ids()
    assert len(ids) == len(set(ids)) == cfg.train.total_steps * cfg.train.prompts_per_step * cfg.train.samples_per_prompt


def test_a_killed_reward_costs_no_rollback_and_needs_no_checkpoint(make_config, tmp_path):
    """The reward holds no training state: its loss is waited out and the lost call repeated
    (`reward.restart_wait_s`), with no checkpoint configured and no step trained again."""
    cfg = make_config("algorithm=grpo", "train.total_steps=16", "train.samples_per_prompt=2", "data.size=256",
                      "checkpoint.at_end=false", "checkpoint.every_minutes=0", "reward.score_delay_s=0.05")
    output, _ = kill_once(cfg, tmp_path, "reward", at_step=3)
    assert "rolefleet: reward exited with code -9 during the run; restarting it" in output
    assert "recovery" not in output  # no rollback to a checkpoint (there is none)
    assert "checkpoints are off during the run" in output and "a lost reward costs nothing" in output
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        trained_once(cfg, journal)
        assert not journal.rewound()
    assert not (cfg.run.out / "checkpoints").exists() or not any((cfg.run.out / "checkpoints").iterdir())


TRAINER_RUN = ("algorithm=ppo", "train.total_steps=8", "train.samples_per_prompt=2", "data.size=256")


@pytest.fixture(scope="module")
def straight_weights(tiny_model_dir, tmp_path_factory) -> dict[str, dict[str, list]]:
    """The final weights of a run of TRAINER_RUN that lost nothing, which each killed trainer's run
    must end with (sync mode: the same seed gives the same weights): one run for both tests."""
    tmp = tmp_path_factory.mktemp("straight")
    straight = tiny_config(tiny_model_dir, tmp, *TRAINER_RUN, f"run.output_dir={tmp / 'straight'}")
    run = rolefleet("up", str(write_config(straight, tmp / "straight.yaml")))
    output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output
    return {part: final_weights(straight, part) for part in ("actor", "critic")}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_under_the_defaults_a_killed_trainer_costs_at_most_the_step_in_flight(make_config, tmp_path, role,
                                                                               straight_weights):
    """The shipped defaults protect a trainer with a snapshot after every step (and the checkpoint of
    step 0 behind it): the run goes on after the last finished step, and ends with the weights of a
    run that lost nothing."""
    cfg = make_config(*TRAINER_RUN, f"run.output_dir={tmp_path / 'killed'}")
    assert cfg.checkpoint.every == 0 and cfg.checkpoint.snapshot.enabled  # the shipped defaults
    output, records = kill_once(cfg, tmp_path, role, at_step=4)
    # Loaded alone from the snapshot of the run's step, the step going on where it was; or (the
    # actor's generation broke, or the snapshot of that step was still being written) the run
    # recovered from the newest snapshot.
    assert f"the {role} came back as a new process; loaded alone from" in output \
        or ("recovery 1 of 3" in output and "finished steps to train again)" in output)
    [after] = [r for r in records if "recovery/steps_lost" in r]
    assert after["recovery/steps_lost"] == 0 and after["step"] >= 5, output[-4000:]  # no recorded step trained again
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        trained_once(cfg, journal)
        # At most the step in flight was trained again: its update may have been applied, its snapshot not.
        assert [step for step, _ in journal.rewound()] in ([], [after["step"]])
    for part in ("actor", "critic"):
        assert final_weights(cfg, part) == straight_weights[part], part


def final_weights(cfg, part: str) -> dict[str, list]:
    """The last checkpoint's trainable weights of `part`, as nested lists (equal means equal)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    [(_, last)] = complete_checkpoints(cfg.run.out / "checkpoints")[-1:]
    out = cfg.run.out / f"{part}.pt"
    dcp_to_torch_save(last / part / "weights", out)
    return {k: v.tolist() for k, v in torch.load(out, weights_only=True)["model"].items()}

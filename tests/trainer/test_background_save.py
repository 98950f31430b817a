"""SaveCheckpoint in the background (`trainer/background.py`): the state of the step asked for, staged
before the next update changes it, written behind it, and committed only once complete."""

import os
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.errors import FailedPrecondition
from rolefleet.critic.core import CriticCore
from rolefleet.trainer import background
from rolefleet.trainer.checkpoint import partial, read_role_json

BATCH = SequenceBatch.from_lists([torch.tensor([4, 41, 5, 45]), torch.tensor([6, 45])],
                                 [torch.tensor([9, 2]), torch.tensor([10, 4, 2])])
RETURNS, OLD = torch.tensor([1.0, 0.5, -1.0, 2.0, 0.0]), torch.zeros(5)


def critic(model_dir: str) -> CriticCore:
    cfg = parse_config({"model": {"model_name_or_path": model_dir}}, ["critic.compute_dtype=float32", "critic.lr=0.05"])
    return CriticCore(cfg.critic)


def slow_staging(monkeypatch, seconds: float) -> None:
    """Staging that starts late: an update that did not wait for it would change what it copies."""
    copy = background.HostCopy._copy

    def late(self, key, value):
        if key == "":
            time.sleep(seconds)
        return copy(self, key, value)

    monkeypatch.setattr(background.HostCopy, "_copy", late)


def test_the_saved_state_is_the_steps_though_the_next_update_runs_while_it_is_written(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    slow_staging(monkeypatch, 0.5)
    core = critic(tiny_model_dir)
    core.update(1, BATCH, RETURNS, OLD)
    after_one = core.digest()
    path = str(tmp_path / "step-1" / "critic")
    answered = core.save_checkpoint(1, path, background=True)
    assert answered.step == 1
    core.update(2, BATCH, RETURNS, OLD)  # at once: it waits only for the copy off the device
    assert core.digest() != after_one
    assert core.save_checkpoint(1, path).step == 1  # the repeat: once the files are complete
    assert read_role_json(Path(path))["last_step"] == 1 and not partial(Path(path)).exists()

    fresh = critic(tiny_model_dir)
    assert fresh.load_checkpoint(path).step == 1
    assert fresh.digest() == after_one  # the state of step 1, not the update that ran meanwhile
    fresh.update(2, BATCH, RETURNS, OLD)
    assert fresh.digest() == core.digest()  # optimizer moments and RNG too: step 2 comes out the same


def test_a_second_background_save_reuses_the_buffers_and_keeps_each_steps_state(tiny_model_dir, tmp_path):
    core = critic(tiny_model_dir)
    digests = {}
    for step in (1, 2, 3):
        core.update(step, BATCH, RETURNS, OLD)
        digests[step] = core.digest()
        core.save_checkpoint(step, str(tmp_path / f"s{step}"), background=True)
    core.save_checkpoint(3, str(tmp_path / "s3"))
    for step in (1, 2, 3):
        fresh = critic(tiny_model_dir)
        fresh.load_checkpoint(str(tmp_path / f"s{step}"))
        assert fresh.digest() == digests[step], step


def test_a_failed_background_write_commits_nothing_and_its_repeat_says_why(tiny_model_dir, tmp_path, monkeypatch):
    def failing(state, weights, host, group):
        staged, written = Future(), Future()
        staged.set_result(None)
        written.set_exception(OSError(28, "No space left on device"))
        return background.TrainerWrite(staged, written)

    monkeypatch.setattr(background, "start_write", failing)
    core = critic(tiny_model_dir)
    core.update(1, BATCH, RETURNS, OLD)
    path = tmp_path / "step-1" / "critic"
    core.save_checkpoint(1, str(path), background=True)
    with pytest.raises(FailedPrecondition, match="No space left on device"):
        core.save_checkpoint(1, str(path))
    assert not path.exists() and not partial(path).exists()
    core.update(2, BATCH, RETURNS, OLD)  # the role goes on: a failed save changed nothing


def test_host_copies_reuse_their_buffers_and_copy_any_state_again():
    """The buffers are the same from one copy to the next (no allocation, no re-pinning), with the
    new values; settings come along, class objects among them (which some torch releases' own
    stager cannot copy a second time)."""
    host = background.HostCopy()
    weights = torch.arange(6.0)
    state = {"model": {"w": weights}, "optim": {"param_groups": [{"lr": 0.1, "kind": torch.optim.AdamW}]}}
    first = host.start(state, lambda staged: staged).written.result()
    weights += 1
    second = host.start(state, lambda staged: staged).written.result()
    assert second["model"]["w"] is first["model"]["w"] and second["model"]["w"].tolist() == [1, 2, 3, 4, 5, 6]
    assert second["model"]["w"] is not weights and second["optim"]["param_groups"][0]["kind"] is torch.optim.AdamW


def test_a_background_write_takes_a_quarter_of_the_cpus_and_a_checkpoint_as_many_as_help(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """A snapshot is written while the rollout engine's host-bound loop runs in the same process: its
    writer threads must leave it CPUs (benchmarks/write_contention.py); a save the step waits for
    does not."""
    threads = []
    save = background.save

    def spy(state, weights, group, *more):
        threads.append(more[0] if more else background.WRITE_THREADS)
        return save(state, weights, group, *more)

    monkeypatch.setattr(background, "save", spy)
    core = critic(tiny_model_dir)
    core.update(1, BATCH, RETURNS, OLD)
    core.save_checkpoint(1, str(tmp_path / "background"), background=True)
    core._writing.wait()
    core.save_checkpoint(1, str(tmp_path / "waited"))
    assert threads == [background.BACKGROUND_WRITE_THREADS, background.WRITE_THREADS]
    cpus = len(os.sched_getaffinity(0))
    assert background.BACKGROUND_WRITE_THREADS == max(1, min(8, cpus // 4))
    assert background.WRITE_THREADS == min(8, cpus)

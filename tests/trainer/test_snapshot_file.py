"""Per-step snapshots (`trainer/snapshot_file.py`): the state of the step asked for, copied into one
of two memory-mapped files per rank, never the one holding the newest complete snapshot; a snapshot
whose file was overwritten or whose write was cut short is refused whole, and nothing is lost."""

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.errors import FailedPrecondition, InvalidArgument
from rolefleet.critic.core import CriticCore
from rolefleet.trainer import snapshot_file
from rolefleet.trainer.checkpoint import partial, read_role_json

BATCH = SequenceBatch.from_lists([torch.tensor([4, 41, 5, 45]), torch.tensor([6, 45])],
                                 [torch.tensor([9, 2]), torch.tensor([10, 4, 2])])
RETURNS, OLD = torch.tensor([1.0, 0.5, -1.0, 2.0, 0.0]), torch.zeros(5)


def critic(model_dir: str, root: Path) -> CriticCore:
    cfg = parse_config({"model": {"model_name_or_path": model_dir}}, ["critic.compute_dtype=float32", "critic.lr=0.05"])
    core = CriticCore(cfg.critic)
    core.snapshot_root = str(root)
    return core


def at(root: Path, step: int) -> str:
    """Where the coordinator asks for the critic's part of the snapshot of `step`."""
    return str(root / "instance" / f"step-{step:08d}" / "critic")


def buffer_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "instance" / "buffers" / "critic").iterdir())


def test_a_snapshot_is_the_steps_state_and_loads_into_a_fresh_trainer(tiny_model_dir, tmp_path):
    core = critic(tiny_model_dir, tmp_path)
    core.update(1, BATCH, RETURNS, OLD)
    after_one = core.digest()
    assert core.save_checkpoint(1, at(tmp_path, 1), background=True).step == 1
    assert read_role_json(Path(at(tmp_path, 1)))["last_step"] == 1 and not partial(Path(at(tmp_path, 1))).exists()
    assert core.save_checkpoint(1, at(tmp_path, 1)).step == 1  # the coordinator's repeat: from disk
    core.update(2, BATCH, RETURNS, OLD)
    assert core.digest() != after_one

    fresh = critic(tiny_model_dir, tmp_path)
    assert fresh.load_checkpoint(at(tmp_path, 1)).step == 1
    assert fresh.digest() == after_one  # the state of step 1, not the update that ran after
    fresh.update(2, BATCH, RETURNS, OLD)
    assert fresh.digest() == core.digest()  # optimizer moments and RNG too: step 2 comes out the same
    # Its weights are copied into a mapped file, not written with torch.distributed.checkpoint.
    weights = Path(at(tmp_path, 1)) / "weights"
    assert sorted(p.name for p in weights.iterdir()) == ["rank-0.layout"]


def test_snapshots_alternate_between_two_files_and_one_overwritten_since_is_refused(tiny_model_dir, tmp_path):
    core = critic(tiny_model_dir, tmp_path)
    digests = {}
    for step in (1, 2, 3):
        core.update(step, BATCH, RETURNS, OLD)
        digests[step] = core.digest()
        core.save_checkpoint(step, at(tmp_path, step), background=True)
        if step == 1:  # kept aside from the role's pruning: its file is the one step 3 overwrites
            shutil.copytree(at(tmp_path, 1), tmp_path / "instance" / "aside" / "critic")
    assert buffer_files(tmp_path) == ["rank-0-0.bin", "rank-0-1.bin"]  # the same two files, reused
    assert not Path(at(tmp_path, 1)).exists()  # pruned: the role keeps its newest complete one

    fresh = critic(tiny_model_dir, tmp_path)
    before = fresh.digest()
    with pytest.raises(InvalidArgument, match="overwritten by a later snapshot"):
        fresh.load_checkpoint(str(tmp_path / "instance" / "aside" / "critic"))
    assert fresh.digest() == before and not fresh.ledger.broken  # refused before anything was touched
    for step in (2, 3):
        fresh.load_checkpoint(at(tmp_path, step))
        assert fresh.digest() == digests[step], step


def test_a_repeated_request_keeps_the_previous_snapshot_until_the_next_one_is_written(tiny_model_dir, tmp_path):
    """The coordinator repeats each trainer's request to learn that its part is complete; until the
    manifest says the whole snapshot is, the previous one is what a recovery loads: a repeat prunes
    nothing (found under load: a recovery met the previous step's actor part removed)."""
    core = critic(tiny_model_dir, tmp_path)
    for step in (1, 2):
        core.update(step, BATCH, RETURNS, OLD)
        core.save_checkpoint(step, at(tmp_path, step), background=True)
    core.save_checkpoint(2, at(tmp_path, 2))  # the repeat
    assert read_role_json(Path(at(tmp_path, 1)))["last_step"] == 1
    core.update(3, BATCH, RETURNS, OLD)
    core.save_checkpoint(3, at(tmp_path, 3), background=True)  # the next one: now step 1's part goes
    assert not Path(at(tmp_path, 1)).exists() and read_role_json(Path(at(tmp_path, 2)))["last_step"] == 2


def test_a_snapshot_part_an_earlier_process_wrote_is_kept_when_a_repeat_answers_from_it(tiny_model_dir, tmp_path):
    """After a recovery to step 1 the step 2 is trained again, and its snapshot request answered from
    the part the lost process wrote (its file 1): the next snapshot must write file 0, or the run's
    newest snapshot (step 2's, once its manifest is written) would be overwritten under it."""
    lost = critic(tiny_model_dir, tmp_path)
    for step in (1, 2):
        lost.update(step, BATCH, RETURNS, OLD)
        lost.save_checkpoint(step, at(tmp_path, step))
    after_two = lost.digest()
    back = critic(tiny_model_dir, tmp_path)
    back.load_checkpoint(at(tmp_path, 1))  # the recovery: file 0's
    back.update(2, BATCH, RETURNS, OLD)
    back.save_checkpoint(2, at(tmp_path, 2), background=True)  # answered from the lost process's part
    back.update(3, BATCH, RETURNS, OLD)
    back.save_checkpoint(3, at(tmp_path, 3), background=True)
    check = critic(tiny_model_dir, tmp_path)
    check.load_checkpoint(at(tmp_path, 2))  # still whole
    assert check.digest() == after_two


def test_a_write_cut_short_commits_nothing_and_the_previous_snapshot_stays(tiny_model_dir, tmp_path, monkeypatch):
    core = critic(tiny_model_dir, tmp_path)
    core.update(1, BATCH, RETURNS, OLD)
    after_one = core.digest()
    core.save_checkpoint(1, at(tmp_path, 1))
    core.update(2, BATCH, RETURNS, OLD)

    def full(self, token, sequence):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(snapshot_file._Mapped, "complete", full)
        with pytest.raises(FailedPrecondition, match="No space left on device"):
            core.save_checkpoint(2, at(tmp_path, 2))
    assert not Path(at(tmp_path, 2)).exists() and not partial(Path(at(tmp_path, 2))).exists()
    fresh = critic(tiny_model_dir, tmp_path)
    fresh.load_checkpoint(at(tmp_path, 1))
    assert fresh.digest() == after_one

    core.update(3, BATCH, RETURNS, OLD)  # the role goes on: a failed snapshot changed nothing
    core.save_checkpoint(3, at(tmp_path, 3))
    fresh.load_checkpoint(at(tmp_path, 3))
    assert fresh.digest() == core.digest()


def test_a_restarted_trainer_writes_over_the_older_file_never_the_snapshot_it_resumed_from(tiny_model_dir, tmp_path):
    first = critic(tiny_model_dir, tmp_path)
    for step in (1, 2):
        first.update(step, BATCH, RETURNS, OLD)
        first.save_checkpoint(step, at(tmp_path, step))
    after_two = first.digest()

    # A new process (no memory of which file is which) that has not loaded anything: the headers say.
    other = critic(tiny_model_dir, tmp_path / "other")
    assert other._snapshot_buffers(at(tmp_path, 0)) == (tmp_path / "other" / "buffers" / "critic").resolve()
    untouched = critic(tiny_model_dir, tmp_path)
    untouched.save_checkpoint(0, str(tmp_path / "instance" / "step-00000000" / "critic"))

    restarted = critic(tiny_model_dir, tmp_path)
    restarted.load_checkpoint(at(tmp_path, 2))
    assert restarted.digest() == after_two
    restarted.update(3, BATCH, RETURNS, OLD)
    restarted.save_checkpoint(3, at(tmp_path, 3))
    check = critic(tiny_model_dir, tmp_path)
    check.load_checkpoint(at(tmp_path, 3))
    assert check.digest() == restarted.digest()
    # Step 3's write went to the other file than step 2's, which is still whole (the role pruned its
    # directory; its layout, kept here before, still reads).
    assert buffer_files(tmp_path) == ["rank-0-0.bin", "rank-0-1.bin"]


def test_a_snapshot_of_a_replicated_tensor_reads_from_the_first_ranks_file(tmp_path):
    """The rule for more than one rank, without processes: a DTensor-free state of rank 1 writes
    nothing itself and loads every tensor from rank 0's file."""
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "optim": {"param_groups": [{"lr": 0.1}]}}
    buffers = [snapshot_file.SnapshotBuffers(), snapshot_file.SnapshotBuffers()]
    weights = tmp_path / "s" / "critic" / "weights"
    for rank in (0, 1):
        buffers[rank].write(state, weights, tmp_path / "buffers", rank, 2)
    live = {"model": {"w": torch.zeros(2, 3)}, "optim": {"param_groups": [{"lr": 0.5}]}}
    snapshot_file.load(live, weights, 1, 2)
    assert live["model"]["w"].tolist() == state["model"]["w"].tolist()
    assert live["optim"]["param_groups"][0]["lr"] == 0.1
    with pytest.raises(FailedPrecondition, match="written by 2 ranks; this trainer has 1"):
        snapshot_file.load(live, weights, 0, 1)
    wrong = {"model": {"w": torch.zeros(3, 2)}, "optim": {"param_groups": [{"lr": 0.5}]}}
    with pytest.raises(FailedPrecondition, match="model.w is not this trainer's shard"):
        snapshot_file.load(wrong, weights, 0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["/dev/shm", "disk"])
def test_a_gpu_trainers_snapshot_is_copied_into_its_files_and_loads_back(tmp_path, where):
    """On a GPU the buffer files in memory (/dev/shm) are page-locked (the copy runs at the link's
    speed); on a disk they cannot be, and the copy goes through pageable memory, the failed attempt
    leaving no error behind. Either way what lands in them is the device's state, bit for bit."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "/dev/shm" else tmp_path
    try:
        weights = torch.randn(1024, 1024, device="cuda")
        state = {"model": {"w": weights}, "optim": {"param_groups": [{"lr": 0.1}]}}
        buffers = snapshot_file.SnapshotBuffers()
        for step in (1, 2, 3):
            weights.add_(1.0)
            buffers.write(state, root / f"s{step}" / "weights", root / "buffers", 0, 1)
        if where == "/dev/shm":
            assert all(m is not None and m.pinned for m in buffers.mapped)
        live = {"model": {"w": torch.zeros(1024, 1024, device="cuda")}, "optim": {"param_groups": [{"lr": 0.5}]}}
        snapshot_file.load(live, root / "s3" / "weights", 0, 1)
        assert torch.equal(live["model"]["w"], weights)
        assert snapshot_file.problem(root / "s1" / "weights", 1) is not None  # overwritten by step 3
        buffers.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

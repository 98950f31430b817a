"""The run's journal: steps and their samples in order, rewind and redo without double training,
checkpoints, starts across reopen, a commit that survives SIGKILL, and a newer schema refused."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sqlite3
from pathlib import Path

import pytest

from rolefleet.coordinator.journal import FILENAME, SCHEMA_VERSION, Journal, JournalError, pack_ids, unpack_ids

BIG = 2**63 - 1  # sample ids are full 64-bit ints, negative ones included


def test_steps_read_back_in_step_order(tmp_path: Path):
    with Journal(tmp_path / FILENAME) as journal:
        assert journal.last_step() == 0 and journal.trained_sample_ids() == []
        journal.record_step(2, [20, 21], policy_version=1)  # recorded out of order: read back in step order
        journal.record_step(1, [10, BIG, -BIG - 1], policy_version=0)
        journal.record_step(3, [], policy_version=2)
        assert journal.last_step() == 3
        assert journal.trained_sample_ids() == [10, BIG, -BIG - 1, 20, 21]


def test_ids_are_stored_as_little_endian_int64():
    assert pack_ids([1, -2]) == (1).to_bytes(8, "little") + (-2).to_bytes(8, "little", signed=True)
    assert unpack_ids(pack_ids([BIG, 0, -1])) == [BIG, 0, -1]
    with pytest.raises(OverflowError):
        pack_ids([2**63])


def test_a_reopened_journal_sees_everything_committed(tmp_path: Path):
    path = tmp_path / FILENAME
    with Journal(path) as journal:
        journal.record_run("demo", {"lr": 1e-6, "roles": ["actor", "critic"]})
        journal.record_step(1, [1, 2, 3], policy_version=0)
        journal.record_step(2, [4, 5, 6], policy_version=1)
        journal.record_checkpoint(2, "ckpt/step-00000002", {"step": 2})
    conn = sqlite3.connect(path)  # WAL is a property of the file, kept for every later connection
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    conn.close()
    with Journal(path) as journal:
        assert journal.starts() == 1
        assert journal.last_step() == 2
        assert journal.trained_sample_ids() == [1, 2, 3, 4, 5, 6]
        assert journal.last_checkpoint() == (2, "ckpt/step-00000002", {"step": 2})


def test_rewound_steps_are_redone_and_counted_once(tmp_path: Path):
    with Journal(tmp_path / FILENAME) as journal:
        for step in range(1, 5):
            journal.record_step(step, [step * 10, step * 10 + 1], policy_version=step - 1)
        journal.record_checkpoint(2, "step-2", {"step": 2})
        journal.record_checkpoint(3, "step-3", {"step": 3})

        assert journal.rewind(2) == [3, 4]
        assert journal.last_step() == 2
        assert journal.trained_sample_ids() == [10, 11, 20, 21]
        # Checkpoint 3 holds undone updates: resuming from it would skip the redo.
        assert journal.checkpoints() == [(2, "step-2")]

        journal.record_step(3, [300], policy_version=2)
        journal.record_step(4, [400], policy_version=3)
        assert journal.trained_sample_ids() == [10, 11, 20, 21, 300, 400]
        assert journal.rewound() == [(3, [30, 31]), (4, [40, 41])]

        assert journal.rewind(4) == []  # nothing after the newest step: nothing undone
        assert journal.rewound() == [(3, [30, 31]), (4, [40, 41])]


def test_recording_a_standing_step_again_is_refused_and_changes_nothing(tmp_path: Path):
    path = tmp_path / FILENAME
    with Journal(path) as journal:
        journal.record_step(1, [1, 2], policy_version=0)
        journal.record_step(2, [3, 4], policy_version=1)
        journal.rewind(1)
        journal.record_step(2, [5, 6], policy_version=1)
        with pytest.raises(ValueError, match="step 2 is already recorded"):
            journal.record_step(2, [7, 8], policy_version=1)
        with pytest.raises(ValueError, match="step 1 is already recorded"):
            journal.record_step(1, [9], policy_version=0)
        with pytest.raises(ValueError, match="count from 1"):
            journal.record_step(0, [9], policy_version=0)
        assert journal.trained_sample_ids() == [1, 2, 5, 6]
        assert journal.rewound() == [(2, [3, 4])]
    with Journal(path) as journal:  # and nothing half-written reached the file
        assert journal.trained_sample_ids() == [1, 2, 5, 6]
        assert journal.last_step() == 2


def test_checkpoints_in_step_order_and_the_newest_with_its_manifest(tmp_path: Path):
    with Journal(tmp_path / FILENAME) as journal:
        assert journal.checkpoints() == [] and journal.last_checkpoint() is None
        journal.record_checkpoint(10, "ckpt/step-00000010", {"step": 10, "roles": {"actor": "ok"}})
        journal.record_checkpoint(5, "ckpt/step-00000005", {"step": 5})
        assert journal.checkpoints() == [(5, "ckpt/step-00000005"), (10, "ckpt/step-00000010")]
        assert journal.last_checkpoint() == (10, "ckpt/step-00000010", {"step": 10, "roles": {"actor": "ok"}})
        with pytest.raises(ValueError, match="step 5 already has a checkpoint"):
            journal.record_checkpoint(5, "elsewhere", {})
        assert journal.checkpoints() == [(5, "ckpt/step-00000005"), (10, "ckpt/step-00000010")]


def test_starts_count_every_start_across_reopen(tmp_path: Path):
    path = tmp_path / FILENAME
    for expected in range(1, 4):
        with Journal(path) as journal:
            journal.record_run("demo", {"attempt": expected})
            assert journal.starts() == expected
    with Journal(path) as journal:
        assert journal.starts() == 3


def record_then_die(path: str) -> None:
    """The child: one committed step, then SIGKILL before any close or exit handler runs."""
    journal = Journal(Path(path))
    journal.record_run("demo", {"child": True})
    journal.record_step(1, [7, 8, 9], policy_version=0)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.procs
def test_a_commit_survives_sigkill_of_its_process(tmp_path: Path):
    path = tmp_path / FILENAME
    # spawn, not fork: the child starts clean rather than from a copy of pytest's threads and locks.
    child = multiprocessing.get_context("spawn").Process(target=record_then_die, args=(str(path),))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the child did not finish recording within 60 s")
    assert child.exitcode == -signal.SIGKILL
    with Journal(path) as journal:
        assert journal.starts() == 1
        assert journal.last_step() == 1
        assert journal.trained_sample_ids() == [7, 8, 9]


def test_a_newer_schema_is_refused_naming_the_file(tmp_path: Path):
    path = tmp_path / FILENAME
    with Journal(path) as journal:
        journal.record_step(1, [1], policy_version=0)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.close()
    with pytest.raises(JournalError, match=re.escape(f"{path}: journal schema version {SCHEMA_VERSION + 1} is newer")):
        Journal(path)
    conn = sqlite3.connect(path)  # refused, and left as it was
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION + 1,)]
    conn.close()

"""The run's journal: what the coordinator started, trained and saved, in `<run>/journal.sqlite`.

A restarted coordinator reads it to resume, and tests read it to prove that across a run with crashes
no sample was lost and none was trained twice. It must therefore hold exactly what was committed when
the process died, whenever that was: SQLite gives atomic transactions and crash recovery without a
server. WAL mode makes a commit one append to `journal.sqlite-wal` (readers never block the writer),
and `synchronous=FULL` fsyncs that append before the commit returns, so a committed record survives
`kill -9` and a power cut too; one fsync per step costs nothing next to a training step.

Tables:

    schema_version  one row: the layout below (a newer one is refused, never guessed at)
    runs            one row per start of the coordinator: name, start time, config as JSON
    steps           one row per trained step: policy version, time, the batch's sample ids as a BLOB of
                    little-endian int64 (a step has thousands of samples: one row each would bloat the
                    file and every read for nothing)
    step_history    the rows `rewind` took out of `steps`, with when: what a resume redid
    checkpoints     one row per checkpoint the run saved: step, directory, manifest as JSON

A step's row exists only while its updates stand. `rewind(after_step)` (resuming from the checkpoint of
`after_step`) moves the later rows to `step_history`, so recording such a step again is a redo, while
recording a step still in `steps` would train its samples twice and is refused.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

SCHEMA_VERSION = 1
FILENAME = "journal.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_name TEXT NOT NULL, started_at REAL NOT NULL,
    config TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, policy_version INTEGER NOT NULL, recorded_at REAL NOT NULL,
    sample_ids BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS step_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, policy_version INTEGER NOT NULL,
    recorded_at REAL NOT NULL, sample_ids BLOB NOT NULL, rewound_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    step INTEGER PRIMARY KEY, path TEXT NOT NULL, manifest TEXT NOT NULL, recorded_at REAL NOT NULL);
"""


class JournalError(RuntimeError):
    """The journal file cannot be used by this RoleFleet (a newer schema)."""


def pack_ids(ids: list[int]) -> bytes:
    """Sample ids as little-endian int64, whatever the machine's byte order (OverflowError past 64 bits)."""
    packed = array("q", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    ids = array("q")
    ids.frombytes(blob)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


class Journal:
    """One coordinator's handle on `path`. The default `check_same_thread` stays on: the coordinator
    calls the journal from its asyncio loop thread only, and sqlite3 then catches any other caller.
    Every call is short and synchronous (at most one fsync), so it runs on the loop directly."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # Autocommit mode: transactions are the explicit `BEGIN IMMEDIATE` of `_write`, not sqlite3's
        # implicit ones, which begin only at the first write and so after the reads they depend on.
        self._conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._create_schema()
        except BaseException:
            self._conn.close()
            raise

    def _create_schema(self) -> None:
        with self._write() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
            if row[0] is None:
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif row[0] > SCHEMA_VERSION:
                # Raised inside the transaction, so a file this version cannot read is left untouched.
                raise JournalError(f"{self.path}: journal schema version {row[0]} is newer than the version "
                                   f"{SCHEMA_VERSION} this RoleFleet reads; resume the run with the RoleFleet "
                                   f"that wrote it")
            # One by one, not executescript: that would commit first and split the transaction.
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction holding the write lock from its first statement: committed on success,
        rolled back on any exception."""
        self._conn.execute("BEGIN IMMEDIATE")
        with self._conn:
            yield self._conn

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- runs -----------------------------------------------------------------------------------

    def record_run(self, run_name: str, config: dict[str, Any]) -> None:
        """A start of the coordinator (the first or a resume) with its config (JSON-serialisable)."""
        text = json.dumps(config, sort_keys=True)
        with self._write() as conn:
            conn.execute("INSERT INTO runs (run_name, started_at, config) VALUES (?, ?, ?)",
                         (run_name, time.time(), text))

    def starts(self) -> int:
        return self._conn.execute("SELECT count(*) FROM runs").fetchone()[0]

    # --- steps ----------------------------------------------------------------------------------

    def record_step(self, step: int, sample_ids: list[int], policy_version: int) -> None:
        """Step `step` was trained on `sample_ids` (its updates applied). ValueError, with nothing
        written, when `step` is already recorded and not rewound: its samples would count twice."""
        if step < 1:
            raise ValueError(f"step {step}: steps count from 1")
        blob = pack_ids(sample_ids)
        try:
            with self._write() as conn:
                conn.execute("INSERT INTO steps (step, policy_version, recorded_at, sample_ids) VALUES (?, ?, ?, ?)",
                             (step, policy_version, time.time(), blob))
        except sqlite3.IntegrityError:
            raise ValueError(f"{self.path}: step {step} is already recorded and was not rewound: "
                             f"recording it again would train its samples twice") from None

    def rewind(self, after_step: int) -> list[int]:
        """Resume from the checkpoint of `after_step`: the steps after it are undone (moved to
        `step_history`) and returned in order. Checkpoints after it are dropped too: they hold
        updates that no longer count, and resuming from one would skip the redo."""
        now = time.time()
        with self._write() as conn:
            steps = [row[0] for row in conn.execute("SELECT step FROM steps WHERE step > ? ORDER BY step",
                                                    (after_step,))]
            conn.execute("INSERT INTO step_history (step, policy_version, recorded_at, sample_ids, rewound_at) "
                         "SELECT step, policy_version, recorded_at, sample_ids, ? FROM steps WHERE step > ? "
                         "ORDER BY step", (now, after_step))
            conn.execute("DELETE FROM steps WHERE step > ?", (after_step,))
            conn.execute("DELETE FROM checkpoints WHERE step > ?", (after_step,))
        return steps

    def last_step(self) -> int:
        """The highest recorded, not rewound step; 0 before the first."""
        return self._conn.execute("SELECT coalesce(max(step), 0) FROM steps").fetchone()[0]

    def trained_sample_ids(self) -> list[int]:
        """The sample ids of every recorded, not rewound step, in step order."""
        ids: list[int] = []
        for (blob,) in self._conn.execute("SELECT sample_ids FROM steps ORDER BY step"):
            ids.extend(unpack_ids(blob))
        return ids

    def rewound(self) -> list[tuple[int, list[int]]]:
        """(step, sample ids) of every undone recording, in the order they were rewound: what was redone."""
        rows = self._conn.execute("SELECT step, sample_ids FROM step_history ORDER BY id")
        return [(step, unpack_ids(blob)) for step, blob in rows]

    # --- checkpoints ----------------------------------------------------------------------------

    def record_checkpoint(self, step: int, path: str, manifest: dict[str, Any]) -> None:
        """The checkpoint of `step` is complete at `path` (its manifest written). ValueError when
        `step` already has one: a re-saved step is first rewound, which drops the old one."""
        text = json.dumps(manifest, sort_keys=True)
        try:
            with self._write() as conn:
                conn.execute("INSERT INTO checkpoints (step, path, manifest, recorded_at) VALUES (?, ?, ?, ?)",
                             (step, str(path), text, time.time()))
        except sqlite3.IntegrityError:
            raise ValueError(f"{self.path}: step {step} already has a checkpoint") from None

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of every recorded checkpoint, in step order."""
        return [(step, path) for step, path in self._conn.execute("SELECT step, path FROM checkpoints ORDER BY step")]

    def last_checkpoint(self) -> Optional[tuple[int, str, dict[str, Any]]]:
        """(step, path, manifest) of the newest checkpoint, or None before the first."""
        row = self._conn.execute("SELECT step, path, manifest FROM checkpoints ORDER BY step DESC LIMIT 1").fetchone()
        return None if row is None else (row[0], row[1], json.loads(row[2]))

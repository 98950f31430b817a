"""What a role is doing while it starts: one JSON line per stage, appended to the file that
ROLEFLEET_PROGRESS_FILE names (`rolefleet up` gives each role its own, beside its ready file), so
that `up` can show "actor: loading weights (3 of 8), 42 s" instead of minutes of silence.

`report` is a no-op where the variable is unset (compose, Helm, tests) and never raises: progress
is advice to a person watching, and a full disk must not stop a model load. Every process of a role
may report (its worker ranks inherit the variable); each line is one `write` of an O_APPEND file,
which the kernel keeps whole between writers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

PROGRESS_FILE_ENV = "ROLEFLEET_PROGRESS_FILE"
_TAIL_BYTES = 4096  # the last line is short; the file may hold many


def report(stage: str, done: int | None = None, total: int | None = None) -> None:
    """Say that this process is at `stage` ("loading weights"), `done` of `total` parts in (shards,
    layers) when it counts them."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    line = json.dumps({"stage": stage, "done": done, "total": total, "time": time.time(), "pid": os.getpid()})
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def latest(path: Path) -> Optional[dict]:
    """The last whole line reported to `path`, or None before the first."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for text in reversed(lines):
        try:
            record = json.loads(text)
        except ValueError:  # a line cut by the tail's start, or still being written
            continue
        if isinstance(record, dict) and isinstance(record.get("stage"), str):
            return record
    return None


def describe(record: Optional[dict]) -> str:
    """"loading weights (3 of 8)"; "starting" before any report."""
    if record is None:
        return "starting (no stage reported yet)"
    done, total = record.get("done"), record.get("total")
    if done is not None and total is not None:
        return f"{record['stage']} ({done} of {total})"
    return record["stage"] if done is None else f"{record['stage']} ({done})"

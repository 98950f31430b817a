"""`run.call_trace`: every role call the coordinator makes, as a slice on a timeline, in
`<run.output_dir>/calls.trace.json`. Open it in Perfetto (ui.perfetto.dev) or chrome://tracing to
see which role waits for which: the per-role busy fractions of the step records say how much, the
trace says when and behind what.

The file is Chrome's trace event format in its JSON array form: "[" then one complete event ("ph":
"X") per line, each followed by a comma, never closed (both viewers accept the open array). So
each call is on disk as soon as it ends, a killed coordinator loses at most the line it was writing,
and a resumed run appends to the same file (timestamps are wall-clock microseconds; a restarted
coordinator shows as a second process).

Tracks: one per role method ("actor.update", "reward.score"...), and another lane of the same name
for each call that overlaps one already in flight (streamed chunks scored at once), so slices on a
track never overlap. The coordinator's own waits and work are on `coordinator.*` tracks, and so is
any time its event loop was blocked (`watch_event_loop`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import IO, NamedTuple

FILE = "calls.trace.json"
BLOCKED, BLOCKED_S = "coordinator.event loop blocked", 0.05


class Call(NamedTuple):
    track: tuple[str, int]  # (role.method, lane)
    start_us: float


class CallTrace:
    def __init__(self, path: Path, run_name: str):
        self.path = Path(path)
        self._file: IO[str] = _open_for_append(self.path)
        self._pid = os.getpid()
        self._tids: dict[tuple[str, int], int] = {}
        self._busy: dict[str, set[int]] = {}  # lanes in flight per role.method
        # Wall-clock microseconds, advanced by the monotonic clock (a clock step mid-run bends nothing).
        self._wall0, self._perf0 = time.time() * 1e6, time.perf_counter()
        self._write({"ph": "M", "name": "process_name", "pid": self._pid,
                     "args": {"name": f"coordinator of run {run_name} (pid {self._pid})"}})

    @classmethod
    def for_run(cls, out: Path, run_name: str) -> CallTrace:
        out.mkdir(parents=True, exist_ok=True)
        return cls(out / FILE, run_name)

    def begin(self, role: str, method: str) -> Call:
        name = f"{role}.{method}"
        busy = self._busy.setdefault(name, set())
        lane = next(i for i in range(len(busy) + 1) if i not in busy)
        busy.add(lane)
        return Call((name, lane), self._now_us())

    def end(self, call: Call, error: BaseException | None = None) -> None:
        self._busy[call.track[0]].discard(call.track[1])
        self._slice(call.track, call.start_us, self._now_us(), error)

    def add(self, name: str, start: float, end: float) -> None:
        """A slice on track `name` from `start` to `end` (`time.perf_counter()` readings) that
        overlaps no other of that track."""
        self._slice((name, 0), self._wall_us(start), self._wall_us(end))

    def _slice(self, track: tuple[str, int], start_us: float, end_us: float,
               error: BaseException | None = None) -> None:
        name, lane = track
        if track not in self._tids:
            self._tids[track] = len(self._tids) + 1
            self._write({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": self._tids[track],
                         "args": {"name": name if lane == 0 else f"{name} ({lane + 1})"}})
        event = {"ph": "X", "name": name, "cat": name.split(".")[0], "pid": self._pid, "tid": self._tids[track],
                 "ts": round(start_us, 1), "dur": round(end_us - start_us, 1)}
        if error is not None:
            event["args"] = {"error": f"{type(error).__name__}: {error}"[:200]}
        self._write(event)

    def close(self) -> None:
        self._file.close()

    def _now_us(self) -> float:
        return self._wall_us(time.perf_counter())

    def _wall_us(self, perf: float) -> float:
        return self._wall0 + (perf - self._perf0) * 1e6

    def _write(self, event: dict) -> None:
        if not self._file.closed:  # a call still in flight when the run ended is left out
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")


async def watch_event_loop(trace: CallTrace, every_s: float = 0.01, threshold_s: float = BLOCKED_S) -> None:
    """Until cancelled: each time the coordinator's event loop ran nothing else for more than
    `threshold_s` (a callback's CPU work, or the GIL held by another thread), a slice over that time
    on the `coordinator.event loop blocked` track. Every call starts and ends on the loop, so a gap
    between one call's end and the next call's start that no wait explains shows up here if the
    loop was the cause."""
    while True:
        due = time.perf_counter() + every_s
        await asyncio.sleep(every_s)
        now = time.perf_counter()
        if now - due > threshold_s:
            trace.add(BLOCKED, due, now)


def _open_for_append(path: Path) -> IO[str]:
    """The trace file, opened to append events: a new one starts the array; an existing one (a
    resumed run) loses a last line cut short by a kill, so that every line stays an event."""
    data = path.read_bytes() if path.exists() else b""
    kept = data[:data.rfind(b"\n") + 1]
    if kept.startswith(b"["):
        if kept != data:
            with open(path, "r+b") as f:
                f.truncate(len(kept))
        return open(path, "a", buffering=1)
    f = open(path, "w", buffering=1)
    f.write("[\n")
    return f


def read_trace(path: Path) -> list[dict]:
    """The events of a trace file (the open array closed), for tests and scripts."""
    text = Path(path).read_text().rstrip().rstrip(",")
    return json.loads(text + "]")

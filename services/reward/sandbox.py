"""A small pool of worker processes that run reward functions which may misbehave.

User reward functions (and the `math` built-in, whose sympy can spin for ever on an answer such as
9^(9^(9^9))) run here rather than in the server: each call has a deadline
(`reward.user_timeout_s`), each worker an address-space limit (`reward.user_memory_mb`), and a
worker that hangs, crashes or runs out of memory costs the samples it was working on, never the
server. Those samples get an error outcome (a str) instead of a score.

Why not concurrent.futures.ProcessPoolExecutor: it cannot cancel a call that is running, and one
worker that dies breaks the whole executor. Why not multiprocessing.Process: with spawn or forkserver
every child re-imports the server's main module (`rolefleet.cli`, which imports torch), which costs
seconds per (re)start and most of the memory limit. So each worker is a plain `python -m
rolefleet.reward.sandbox_worker` started with subprocess, talking over a multiprocessing Connection
(a socketpair); a worker past its deadline is SIGKILLed with its process group and started again.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import Pipe
from typing import Any, Optional

from rolefleet.reward.sandbox_worker import Outcome

log = logging.getLogger(__name__)

# Loading a user file may import heavy libraries; a worker that is not ready by then is broken.
START_TIMEOUT_S = 120.0
# Parts per worker a list of single-sample calls is cut into: small enough that a slow sample
# does not hold up many others, large enough that each part is one message, not one per sample.
PARTS_PER_WORKER = 4
AGENT_GRACE_S = 30.0


@dataclass(frozen=True)
class Target:
    """A function the workers import: `attr` of the module named `where` (kind "module") or of the
    Python file at `where` (kind "file"), called with `options` as keyword arguments."""

    kind: str
    where: str
    attr: str
    options: dict[str, Any] = field(default_factory=dict)


class WorkerFailed(Exception):
    """The worker could not give the sample in flight an outcome; the message says why."""


class LoadError(Exception):
    """Workers could not import some targets: `errors` maps each such key to the reason."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def _how(returncode: Optional[int]) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class _Lost(Exception):
    """The worker stopped answering: it passed a deadline (and was killed) or it died."""

    def __init__(self, timed_out: bool, how: str):
        self.timed_out, self.how = timed_out, how


class _Slot:
    """One worker process, (re)started on demand, and the server's end of its connection. Used by
    one thread at a time (the pool hands slots out through a queue)."""

    def __init__(self, init: dict, closed: threading.Event, timeout_key: str = "reward.user_timeout_s"):
        self.init, self.timeout_key = init, timeout_key
        self.closed = closed
        self.proc: Optional[subprocess.Popen] = None
        self.conn = None
        self.loaded: set[str] = set()

    def start(self) -> None:
        if self.closed.is_set():
            raise WorkerFailed("the reward server is shutting down")
        ours, theirs = Pipe()
        try:
            # Its own session: killing the group also ends anything the user function started.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rolefleet.reward.sandbox_worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self.conn, self.loaded = ours, set()
        self._request(self.init, "start")

    def load(self, key: str) -> Optional[str]:
        """Import target `key` in the worker (once per process); why it could not, or None."""
        if key not in self.loaded:
            if (error := self._request(("load", key, None), "load the reward functions")) is not None:
                return error
            self.loaded.add(key)
        return None

    def ensure(self, key: str) -> None:
        """A live worker with `key` loaded; WorkerFailed when there can be none."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self.start()
        if (error := self.load(key)) is not None:
            raise WorkerFailed(f"could not be loaded: {error}")

    def _request(self, message: Any, doing: str) -> Any:
        try:
            self._send(message)
            return self._next(START_TIMEOUT_S)
        except _Lost as lost:
            raise WorkerFailed(f"a worker did not {doing} within {START_TIMEOUT_S:g} s" if lost.timed_out
                               else f"a worker died as it tried to {doing} ({lost.how})") from None

    def send(self, message: tuple) -> None:
        """Send a call; WorkerFailed when the worker is gone."""
        try:
            self._send(message)
        except _Lost as lost:
            raise WorkerFailed(f"its worker died ({lost.how}) and was replaced") from None

    def receive(self, timeout_s: float) -> Any:
        """The next reply to a call; WorkerFailed when none comes in time (the worker is killed) or
        the worker died or gave up."""
        try:
            return self._next(timeout_s)
        except _Lost as lost:
            raise WorkerFailed(f"timed out after {timeout_s:g} s ({self.timeout_key}), its worker killed "
                               "and replaced" if lost.timed_out else f"its worker died ({lost.how}) and was "
                               "replaced") from None

    def _send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except OSError:
            raise _Lost(False, self.kill(grace_s=1.0)) from None

    def _next(self, timeout_s: float) -> Any:
        try:
            if not self.conn.poll(timeout_s):
                self.kill()  # at once: a call past its deadline may never return
                raise _Lost(True, "killed")
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            raise _Lost(False, self.kill(grace_s=1.0)) from None
        if kind == "fatal":
            self.kill(grace_s=1.0)
            raise WorkerFailed(f"{payload}, its worker replaced")
        return payload

    def kill(self, grace_s: float = 0.0) -> str:
        """Stop the worker (if any) with its process group; how it ended. `grace_s`: time to let a
        worker that is exiting on its own finish, so that its own exit status is reported."""
        proc, self.proc = self.proc, None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if proc is None:
            return "not running"
        if grace_s:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return _how(proc.wait())


class SandboxPool:
    """`run(key, items, batched)` -> one Outcome per item, computed by `workers` processes."""

    def __init__(self, targets: dict[str, Target], workers: int, timeout_s: float, memory_mb: int,
                 section: str = "reward.user"):
        """`section`: the prefix of the config keys of the limits, named in errors (`reward.env`:
        reward.env.timeout_s, reward.env.memory_mb)."""
        self.workers, self.timeout_s = workers, timeout_s
        self._closed = threading.Event()
        init = {"memory_mb": memory_mb, "memory_key": f"{section}_memory_mb" if section == "reward.user"
                else f"{section}.memory_mb",
                "targets": {k: (t.kind, t.where, t.attr, t.options) for k, t in targets.items()}}
        timeout_key = f"{section}_timeout_s" if section == "reward.user" else f"{section}.timeout_s"
        self._all = [_Slot(init, self._closed, timeout_key) for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self._revivals: list[threading.Thread] = []
        self._lock = threading.Lock()
        # One thread per worker: each part of a call holds one slot while it runs.
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="reward-sandbox")
        try:
            reports = list(self._threads.map(lambda slot: self._start(slot, list(targets)), self._all))
        except WorkerFailed:
            self.close()
            raise
        errors = {k: e for report in reports for k, e in report.items() if e is not None}
        if errors:
            self.close()
            raise LoadError(errors)
        for slot in self._all:
            self._idle.put(slot)

    @staticmethod
    def _start(slot: _Slot, keys: list[str]) -> dict[str, Optional[str]]:
        """Start a worker with every target loaded (each import checked, and warm for the first
        call); the load errors by key."""
        slot.start()
        return {key: slot.load(key) for key in keys}

    def run(self, key: str, items: Sequence[Any], batched: bool = False) -> list[Outcome]:
        """Score `items` (ScoreItem-like) with target `key`. A batched target gets at most one call
        per worker, each with a part of the items as lists."""
        rows = [(i.prompt, i.response, i.ground_truth, dict(i.extra)) for i in items]
        parts = _split(rows, self.workers if batched else self.workers * PARTS_PER_WORKER)
        futures = [self._threads.submit(self._run_part, key, part, batched) for part in parts]
        return [outcome for f in futures for outcome in f.result()]

    def step(self, key: str, rows: Sequence[tuple]) -> list[Any]:
        """An environment's answers (dicts, or a str saying why there is none) to `rows` of
        (prompt, messages, ground_truth, extra), computed like single-sample reward calls."""
        parts = _split(list(rows), self.workers * PARTS_PER_WORKER)
        futures = [self._threads.submit(self._run_part, key, part, False, "step") for part in parts]
        return [outcome for f in futures for outcome in f.result()]

    def agents(self, key: str, rows: Sequence[tuple], concurrency: int, timeout_s: float,
               tls: dict[str, str] | None = None) -> list[Outcome]:
        """Agent episodes (rows of base_url, key, prompt, ground_truth, extra) in nearly equal parts
        of at most `concurrency`, one per worker where they fit, each part run at once by one
        worker, each episode within `timeout_s`. A worker that does not answer by then (an agent
        that blocks its loop) is killed: its part's episodes fail, no other. `tls`: the clients'
        files (`agents.client_tls`)."""
        rows = list(rows)
        # Spread over every worker, not filled one worker's concurrency at a time: a worker's loop
        # runs its agents' clients one after another (~1 ms a request each), so a part twice as big
        # makes its turn's requests reach the endpoint twice as late, and the engine waits for them.
        parts = _split(rows, max(self.workers, -(-len(rows) // concurrency)))
        futures = [self._threads.submit(self._agents_part, key, part, timeout_s, tls) for part in parts]
        return [outcome for f in futures for outcome in f.result()]

    def _agents_part(self, key: str, rows: list[tuple], timeout_s: float,
                     tls: dict[str, str] | None) -> list[Outcome]:
        slot = self._idle.get()
        try:
            slot.ensure(key)
            slot.send(("agents", key, (rows, timeout_s, tls)))
            # Each episode ends by its own deadline in the worker; the grace covers the loop's wind-down.
            return slot.receive(timeout_s + AGENT_GRACE_S)
        except WorkerFailed as e:
            return [str(e)] * len(rows)
        finally:
            self._give_back(slot)

    def _run_part(self, key: str, rows: list[tuple], batched: bool, op: str = "each") -> list[Outcome]:
        slot = self._idle.get()
        try:
            return self._batch(slot, key, rows) if batched else self._each(slot, key, rows, op)
        finally:
            self._give_back(slot)

    def _give_back(self, slot: _Slot) -> None:
        """A slot after a call: idle again, or (its worker gone) revived first."""
        if slot.proc is None and not self._closed.is_set():
            # Its worker was killed or died on the last sample: replace it now, between
            # requests, rather than at the start of the next one.
            revival = threading.Thread(target=self._revive, args=(slot, sorted(slot.loaded)),
                                       name="reward-sandbox-revive", daemon=True)
            with self._lock:  # close() joins those still running
                self._revivals = [t for t in self._revivals if t.is_alive()] + [revival]
            revival.start()
        else:
            self._idle.put(slot)

    def _revive(self, slot: _Slot, keys: list[str]) -> None:
        try:
            self._start(slot, keys)
        except WorkerFailed as e:  # the next call tries again, and its samples say why
            log.warning("could not replace a reward worker: %s", e)
        finally:
            self._idle.put(slot)

    def _each(self, slot: _Slot, key: str, rows: list[tuple], op: str = "each") -> list[Outcome]:
        outcomes: list[Outcome] = []
        while len(outcomes) < len(rows):
            rest = rows[len(outcomes):]
            try:
                slot.ensure(key)
            except WorkerFailed as e:
                return outcomes + [str(e)] * len(rest)
            try:
                slot.send((op, key, rest))
                for _ in rest:
                    outcomes.append(slot.receive(self.timeout_s))
            except WorkerFailed as e:  # the sample in flight; the rest go to the replacement
                outcomes.append(str(e))
        return outcomes

    def _batch(self, slot: _Slot, key: str, rows: list[tuple]) -> list[Outcome]:
        try:
            slot.ensure(key)
        except WorkerFailed as e:
            return [str(e)] * len(rows)
        try:
            slot.send(("batch", key, rows))
            reply = slot.receive(self.timeout_s)
        except WorkerFailed as e:
            reply = str(e)
        return [reply] * len(rows) if isinstance(reply, str) else reply

    def close(self) -> None:
        """Stop every worker, at once: a call in flight ends with an error outcome."""
        self._closed.set()
        for slot in self._all:
            proc = slot.proc
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._threads.shutdown(wait=True)
        with self._lock:
            revivals = list(self._revivals)
        for revival in revivals:
            revival.join()
        for slot in self._all:
            slot.kill()


def _split(rows: list, parts: int) -> list[list]:
    """`rows` in at most `parts` contiguous, nearly equal, non-empty parts."""
    parts = max(1, min(parts, len(rows)))
    size, extra = divmod(len(rows), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:])]

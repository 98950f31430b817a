"""User reward functions in worker processes: whatever one does to its worker, only its samples
pay (an error and the fallback), the worker is replaced and the core keeps scoring."""

import math
import os
import time
from pathlib import Path

import pytest

from rolefleet.common import metrics
from rolefleet.common.config import RewardSection
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import ScoreItem
from tests.e2e.procs import children_of

USER_FILE = Path(__file__).with_name("user_rewards.py")
# Long enough for the `alloc` sample to fill 256 MB before its deadline on a loaded machine (a
# MemoryError, not a timeout), short against the `sleep` sample's 60 s.
TIMEOUT_S = 5.0


def workers() -> list[int]:
    """Live reward worker processes of this test process."""
    return [pid for pid in children_of(os.getpid())
            if b"sandbox_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def core():
    core = RewardCore(RewardSection(
        sources=[{"name": "mine", "kind": "user", "path": f"{USER_FILE}:misbehave", "weight": 0.5},
                 {"name": "batch", "kind": "user", "path": f"{USER_FILE}:lengths", "batched": True, "weight": 0.0},
                 {"function": "exact_match"}],
        user_workers=2, user_timeout_s=TIMEOUT_S, user_memory_mb=256, fallback_score=-2.0))
    yield core
    core.close()
    assert workers() == []  # closing the core ends its workers


EXPECTED = {
    "raise": "mine: raised ZeroDivisionError: division by zero",
    "sleep": f"mine: timed out after {TIMEOUT_S:g} s (reward.user_timeout_s), its worker killed and replaced",
    "exit": "mine: its worker died (exited with code 7) and was replaced",
    "segfault": "mine: its worker died (killed by SIGSEGV) and was replaced",
    "alloc": "mine: ran out of memory (MemoryError, over reward.user_memory_mb=256), its worker replaced",
    "text": "mine: returned '1.0', not a number",
    "nan": "mine: returned nan, not a finite float32 number",
}


@pytest.mark.procs
def test_misbehaving_user_functions_cost_only_their_samples(core):
    before = workers()
    assert len(before) == 2
    counted = metrics.REWARD_ERRORS.labels("reward", "mine")._value.get()
    responses = ["good", *EXPECTED, "fine"]
    items = [ScoreItem("p", r, r, {"bonus": 10} if r == "good" else {}) for r in responses]
    start = time.monotonic()
    result = core.score(items)
    elapsed = time.monotonic() - start
    assert errors_of(result, "mine") == ["", *EXPECTED.values(), ""]
    mine = result.sources["mine"].tolist()
    assert mine[0] == 14.0 and mine[-1] == 4.0  # len(response) + extra["bonus"]: extra reaches the function
    assert all(math.isnan(s) for s in mine[1:-1])
    # Each failed sample counts the fallback (-2) for `mine`; exact_match scored every one.
    assert result.total.tolist() == [0.5 * 14 + 1, *[0.5 * -2 + 1] * len(EXPECTED), 0.5 * 4 + 1]
    assert metrics.REWARD_ERRORS.labels("reward", "mine")._value.get() == counted + len(EXPECTED)
    # The hung worker was killed at its deadline, not waited for (it sleeps 60 s).
    assert elapsed < 6 * TIMEOUT_S
    # The workers that died or were killed are gone; replacements serve (started in the background).
    deadline = time.monotonic() + 30
    while set(before) & set(workers()) or len(workers()) != 2:
        assert time.monotonic() < deadline, (before, workers())
        time.sleep(0.1)
    start = time.monotonic()
    assert core.score([ScoreItem("p", "ok", "ok")]).total.tolist() == [0.5 * 2 + 1]
    assert time.monotonic() - start < TIMEOUT_S  # no hung worker in the way


def errors_of(result, source: str) -> list[str]:
    """Each sample's error from `source` ("" where it scored)."""
    return [next((part for part in e.split("; ") if part.startswith(f"{source}: ")), "") for e in result.errors]


@pytest.mark.procs
def test_batched_user_function(core):
    result = core.score([ScoreItem("p", "abc", ""), ScoreItem("p", "none", ""), ScoreItem("p", "de", "")])
    assert result.sources["batch"][0] == 3.0 and result.sources["batch"][2] == 2.0
    assert errors_of(result, "batch") == ["", "batch: returned None, not a number", ""]  # one bad value, one sample
    # Two workers: four samples go in two calls of two. A call that raises, or answers with the
    # wrong number of values, fails the samples of that call only.
    result = core.score([ScoreItem("p", r, "") for r in ("raise", "a", "b", "c")])
    assert errors_of(result, "batch") == ["batch: raised RuntimeError: bad batch"] * 2 + ["", ""]
    assert result.sources["batch"].tolist()[2:] == [1.0, 1.0]
    result = core.score([ScoreItem("p", "short", "")] * 4)
    assert errors_of(result, "batch") == ["batch: returned 1 values for 2 samples"] * 4

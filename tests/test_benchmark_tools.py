"""The trace readers the GPU benchmarks are read with (benchmarks/profile_gaps.py,
benchmarks/trace_steps.py), on hand-made traces whose answers are known."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_gaps_counts_gpu_busy_time_and_names_the_cpu_ops_of_the_longest_gap(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 250},
              {"ph": "X", "cat": "cpu_op", "name": "aten::index_put_", "ts": 200, "dur": 190},
              {"ph": "X", "cat": "kernel", "name": "a", "ts": 10, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "b", "ts": 105, "dur": 50},   # overlaps a: one stretch
              {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 160, "dur": 40},
              {"ph": "X", "cat": "kernel", "name": "d", "ts": 400, "dur": 100}]
    path = tmp_path / "actor-update1-rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    profile_gaps = load("profile_gaps")
    assert profile_gaps.busy_intervals(events) == [(10, 155), (160, 200), (400, 500)]
    text = profile_gaps.summarize(path, top=1)
    assert "span 0.5 ms, GPU busy 0.3 ms (57%), 3 busy stretches" in text
    assert "idle in gaps of 100-1000 µs: 0.2 ms (1 gaps)" in text      # 200-400, the host's
    assert "idle in gaps of 0-10 µs: 0.0 ms (1 gaps)" in text          # b to c
    assert "idle in gaps of 10-100 µs: 0.0 ms (1 gaps)" in text        # before a
    longest = text.splitlines()[-1]
    assert "0.20  aten::index_put_ (0.19), aten::mm (0.05)" in longest  # the ops by their share of the gap


def test_trace_steps_reads_step_time_and_busy_between_two_updates():
    updates = [{"ph": "X", "name": "actor.update", "ts": end - 100, "dur": 100} for end in (1e6, 2e6, 3.5e6, 4e6)]
    counters = [{"ph": "C", "name": "GPU busy %", "ts": t, "args": {"gpu0": g0, "gpu1": 50}}
                for t, g0 in ((0.5e6, 0), (2.5e6, 100), (3e6, 60))]
    trace_steps = load("trace_steps")
    window = trace_steps.window(updates + counters, after=2, until=3)
    assert window["steps"] == 1 and window["step_s"] == pytest.approx(1.5)
    assert window["busy"] == {"gpu0": pytest.approx(0.8), "gpu1": pytest.approx(0.5)} and window["samples"] == 2
    with pytest.raises(SystemExit, match="4 updates"):
        trace_steps.window(updates, after=3, until=5)


def test_mean_busy_leaves_out_the_samples_of_the_steps_asked():
    gpu_e2e = load("gpu_e2e")
    samples = [[80, 60], [90, 70], [0, 100], [10, 100], [70, 50]]
    steps = [4, 4, 5, 5, 6]  # step 5 recompiled: one GPU compiling, the other idle
    assert gpu_e2e.mean_busy(samples, steps) == pytest.approx([0.5, 0.76])
    assert gpu_e2e.mean_busy(samples, steps, frozenset({5})) == pytest.approx([0.8, 0.6])
    assert gpu_e2e.mean_busy(samples, steps, frozenset({4, 5, 6})) == []

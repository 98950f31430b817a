"""Step time and NVML busy fraction between two updates, read from a run's call trace (the
`calls.trace.json` of `run.call_trace`, with the "GPU busy %" counters that `gpu_e2e.py` and
`placement.py` add to it): for a window of steps that the run's own medians cannot isolate, such
as the steps before a profiled one.

    python benchmarks/trace_steps.py OUT/traces/grpo_rollout_async.trace.json --after 2 --until 6

The window runs from the end of update `--after` to the end of update `--until` (1: the run's
first update); the step time is its length over the updates in it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from rolefleet.coordinator.call_trace import read_trace


def window(events: list[dict], after: int, until: int) -> dict:
    updates = sorted(e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and e["name"] == "actor.update")
    if not 1 <= after < until <= len(updates):
        raise SystemExit(f"the trace has {len(updates)} updates: need 1 <= --after < --until <= {len(updates)}")
    start, end = updates[after - 1], updates[until - 1]
    samples = [e["args"] for e in events if e.get("ph") == "C" and start <= e["ts"] <= end]
    gpus = sorted({key for sample in samples for key in sample})
    return {"steps": until - after, "step_s": (end - start) / 1e6 / (until - after),
            "busy": {gpu: statistics.mean(s[gpu] for s in samples) / 100 for gpu in gpus}, "samples": len(samples)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace", type=Path)
    p.add_argument("--after", type=int, required=True, help="the window starts as this update ends")
    p.add_argument("--until", type=int, required=True, help="... and ends as this one does")
    p.add_argument("--tokens", type=int, default=64 * 4 * 256, help="generated tokens per step (tokens/s)")
    args = p.parse_args()
    w = window(read_trace(args.trace), args.after, args.until)
    busy = ", ".join(f"{gpu} {value:.0%}" for gpu, value in w["busy"].items())
    print(f"{args.trace.name}: {w['steps']} steps, {w['step_s']:.3f} s a step, {args.tokens / w['step_s'] / 1e3:.1f}k "
          f"tokens/s; NVML busy {busy} ({w['samples']} samples)")


if __name__ == "__main__":
    main()

"""Where a profiled call left its GPU idle, from the Chrome trace torch.profiler wrote for it
(`actor.profile_updates`, `actor.rollout.profile_generates`, `critic.profile_updates`).

Prints the call's span, the time any kernel (or copy, or memset) ran on the GPU, the idle time
by gap length (gaps of a few microseconds are the GPU moving from one kernel to the next; long
ones are the host not feeding it), and the longest gaps with the CPU ops that ran through them.

    python benchmarks/profile_gaps.py OUT/profiles/run/actor-update8-rank1.json [--top 12]

Several traces: one summary each. Needs no GPU (a trace of a CPU run has no kernels to count).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
BUCKETS_US = (10, 100, 1000)  # gap lengths: < 10 µs, < 100 µs, < 1 ms, longer


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the GPU's work intervals (µs), in order."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") in GPU_WORK)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarize(path: Path, top: int) -> str:
    events = json.loads(path.read_text())["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    begin, end = min(e["ts"] for e in timed), max(e["ts"] + e["dur"] for e in timed)
    busy = busy_intervals(events)
    edges = [begin, *(t for span in busy for t in span), end]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]  # before, between and after the work
    span_us, busy_us = end - begin, sum(b - a for a, b in busy)
    lines = [f"{path.name}: span {span_us / 1e3:.1f} ms, GPU busy {busy_us / 1e3:.1f} ms "
             f"({busy_us / span_us:.0%}), {len(busy)} busy stretches"]
    bounds = (0, *BUCKETS_US, float("inf"))
    for low, high in zip(bounds, bounds[1:]):
        inside = [b - a for a, b in gaps if low <= b - a < high]
        label = f"{low:g}-{high:g} µs" if high != float("inf") else f">= {low:g} µs"
        lines.append(f"  idle in gaps of {label}: {sum(inside) / 1e3:.1f} ms ({len(inside)} gaps)")
    cpu_ops = [e for e in timed if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    lines.append(f"  the {top} longest gaps (ms from the start: length; CPU ops covering most of each):")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        over = sorted(((min(b, e["ts"] + e["dur"]) - max(a, e["ts"]), e["name"]) for e in cpu_ops
                       if e["ts"] < b and e["ts"] + e["dur"] > a), reverse=True)
        names = ", ".join(f"{name[:60]} ({cover / 1e3:.2f})" for cover, name in over[:3]) or "no CPU op"
        lines.append(f"    {(a - begin) / 1e3:8.1f}: {(b - a) / 1e3:6.2f}  {names}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=12, help="longest gaps listed per trace")
    args = p.parse_args()
    for path in args.traces:
        print(summarize(path, args.top), flush=True)


if __name__ == "__main__":
    main()

"""What the per-step snapshots (`checkpoint.snapshot`) cost a run on one GPU: `rolefleet up
configs/gpu_1x.yaml` on random weights of real dimensions, PPO (the actor's and the critic's states
both snapshotted), the same run with snapshots off and on, side by side in one call.

    python benchmarks/snapshot_overhead.py --out OUT [--shapes qwen2-0.5b,qwen2-1.5b --algorithms ppo,grpo]
        [--steps 16] [--pairs 1]

The figure is the run's step period: the time between consecutive step records as they reach
metrics.jsonl (polled every 10 ms), median over the steps after the first `--warmup` (compilation).
A snapshot's records come once its files are complete, behind the next step, so in a steady run the
period is what a step costs with its snapshot. Also reported: the step's wait for the trainers'
staging (`checkpoint/snapshot_s`) and the time to a complete snapshot (`checkpoint/snapshot_write_s`),
medians; OUT/snapshot_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import _run_to_the_end  # noqa: E402

from rolefleet.app.tiny_model import make_tiny_model  # noqa: E402


class RecordClock(threading.Thread):
    """The wall-clock time each line of a metrics.jsonl appeared at."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.times, self.done = path, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            try:
                lines = self.path.read_bytes().count(b"\n")
            except FileNotFoundError:
                continue
            now = time.monotonic()
            self.times += [now] * (lines - len(self.times))


def median_of(records: list[dict], key: str, after: int) -> float | None:
    values = [r[key] for r in records if r.get("step", 0) > after and key in r]
    return statistics.median(values) if values else None


def measure(shape: str, model: Path, work: Path, snapshots: bool, steps: int, warmup: int, config: str,
            algorithm: str, extra: list[str]) -> dict:
    run_dir = work / f"{shape}-{'on' if snapshots else 'off'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", config, f"algorithm={algorithm}",
           f"model.model_name_or_path={model}", f"run.output_dir={run_dir}", f"train.total_steps={steps}",
           "checkpoint.every_minutes=0", "checkpoint.at_end=false", f"checkpoint.snapshot.enabled={snapshots}",
           f"checkpoint.snapshot.dir={work / 'shm'}", *extra]
    clock = RecordClock(run_dir / "metrics.jsonl")
    clock.start()
    proc = _run_to_the_end(cmd)
    clock.done.set()
    clock.join()
    if proc.returncode != 0:
        return {"shape": shape, "algorithm": algorithm, "snapshots": snapshots, "error": (proc.stdout[-2000:] + proc.stderr[-3000:])}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_at = {r["step"]: t for r, t in zip(records, clock.times) if "step" in r}
    periods = [steps_at[s] - steps_at[s - 1] for s in sorted(steps_at) if s - 1 in steps_at and s > warmup + 1]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"shape": shape, "algorithm": algorithm, "snapshots": snapshots, "steps": steps, "period_median_s": statistics.median(periods),
            "periods_s": [round(p, 3) for p in periods],
            "step_s_median": median_of(records, "timing/step_s", warmup),
            "snapshot_staging_s_median": median_of(records, "checkpoint/snapshot_s", warmup),
            "snapshot_write_s_median": median_of(records, "checkpoint/snapshot_write_s", warmup)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen2-0.5b")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pairs", type=int, default=1, help="off/on pairs per shape (alternating)")
    p.add_argument("--work", default="/tmp/snapshot_overhead")
    p.add_argument("--algorithms", default="ppo",
                   help="per shape, comma-separated (the last for the rest): ppo snapshots the actor and the critic, "
                        "grpo the actor alone (a 1.5B actor and critic do not fit one GPU in gpu_1x.yaml's settings)")
    p.add_argument("--config", default="configs/gpu_1x.yaml", help="configs/demo.yaml: a CPU smoke run")
    p.add_argument("--set", action="append", default=[], help="a config override for every run")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    algorithms = args.algorithms.split(",")
    for i, shape in enumerate(args.shapes.split(",")):
        algorithm = algorithms[min(i, len(algorithms) - 1)]
        model = work / "models" / shape
        if not (model / "tokenizer_config.json").exists():
            make_tiny_model(model, shape=shape)
        for _ in range(args.pairs):
            for snapshots in (False, True):
                row = measure(shape, model, work, snapshots, args.steps, args.warmup, args.config, algorithm,
                              args.set)
                print(json.dumps(row), flush=True)
                results.append(row)
                (out / "snapshot_overhead.json").write_text(json.dumps(results, indent=2))
        off = [r["period_median_s"] for r in results if r["shape"] == shape and not r["snapshots"] and "error" not in r]
        on = [r["period_median_s"] for r in results if r["shape"] == shape and r["snapshots"] and "error" not in r]
        if off and on:
            print(f"{shape}: step period {statistics.median(off):.3f} s without snapshots, {statistics.median(on):.3f} s "
                  f"with: overhead {statistics.median(on) / statistics.median(off) - 1:+.1%}", flush=True)


if __name__ == "__main__":
    main()

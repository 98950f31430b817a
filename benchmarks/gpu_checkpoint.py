"""What a checkpoint costs on one GPU: `rolefleet up configs/gpu_1x.yaml` on random weights of real
dimensions, a checkpoint every 2 steps (and of step 0, as the defaults save it), timed from the
coordinator's own log line ("checkpoint of step N written to ... in X s"), with each checkpoint's
bytes per role and the run's median step time; the cost of the default (one checkpoint every
`checkpoint.every_minutes`) as a share of the training time it protects.

    python benchmarks/gpu_checkpoint.py --out OUT_DIR [--shapes qwen2-0.5b,qwen2-1.5b] [--algorithms grpo,ppo]

Checkpoints go under --work (large: the fp32 weights and the AdamW moments of every trainer); only
the JSON summary goes to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import _run_to_the_end, count_parameters  # noqa: E402

from rolefleet.app.tiny_model import make_tiny_model  # noqa: E402

SAVED = re.compile(r"checkpoint of step (\d+) written to \S+ in ([\d.]+) s")
DEFAULT_EVERY_MINUTES = 30.0


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(shape: str, algorithm: str, work: Path, steps: int) -> dict:
    model = work / shape
    if not model.exists():
        make_tiny_model(model, shape=shape)
    run_dir = work / f"{shape}-{algorithm}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "rolefleet.cli", "--log-level", "info", "up", "configs/gpu_1x.yaml",
           f"algorithm={algorithm}", f"model.model_name_or_path={model}", f"run.output_dir={run_dir}",
           f"train.total_steps={steps}", "checkpoint.every=2", "checkpoint.every_minutes=0", "checkpoint.keep=1"]
    start = time.perf_counter()
    proc = _run_to_the_end(cmd)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{shape} {algorithm}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    saves = {int(step): float(s) for step, s in SAVED.findall(proc.stdout + proc.stderr)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["timing/step_s"] for r in records[1:])
    [last] = sorted((run_dir / "checkpoints").glob("step-*"))
    parts = {p.name: directory_bytes(p) for p in last.iterdir() if p.is_dir()}
    later = [s for step, s in saves.items() if step > 0]  # step 0's comes before any optimizer state exists
    save_s = statistics.median(later)
    result = {
        "shape": shape, "algorithm": algorithm, "parameters": count_parameters(model), "wall_s": wall,
        "saves_s": saves, "save_s": save_s, "step_s": step_s, "bytes": parts, "gib": sum(parts.values()) / 2**30,
        "gib_per_s": sum(parts.values()) / 2**30 / save_s,
        # The default: one checkpoint per `every_minutes` of training, each stopping the run for `save_s`.
        "default_overhead": save_s / (DEFAULT_EVERY_MINUTES * 60),
        "saves_per_hour_at_1pct": 0.01 * 3600 / save_s,
    }
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/rolefleet-checkpoint-bench")
    p.add_argument("--shapes", default="qwen2-0.5b,qwen2-1.5b")
    p.add_argument("--algorithms", default="grpo")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shapes.split(","):
        for algorithm in args.algorithms.split(","):
            results.append(measure(shape, algorithm, work, args.steps))
            print(json.dumps(results[-1]), flush=True)
            (out / "checkpoint.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

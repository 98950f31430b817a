"""Sync against async on the CPU: `rolefleet up configs/demo_grpo.yaml` (real role processes, the
demo's tiny model) in `pipeline.mode: sync` and `async`, with the reward made as slow as the actor
(`reward.score_delay_s`, calibrated by a first sync run: the median of the actor's seconds per step),
so that overlapping the two can pay. Prints seconds per step, generated tokens per second, the
ratio, and each role's busy fraction (`busy/<role>`: the share of a step's time a call to the role
was in flight).

    python benchmarks/pipeline.py --out OUT_DIR [--steps 30] [--max-staleness 1] [--reward-delay S]

Medians over the steps after the first two (start-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rolefleet.app.tiny_model import make_tiny_model


def up(model: Path, out: Path, name: str, steps: int, *overrides: str) -> list[dict]:
    run_dir = out / name
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", "configs/demo_grpo.yaml", f"model.model_name_or_path={model}",
           f"run.output_dir={run_dir}", f"train.total_steps={steps}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    later = records[2:] or records

    def median(key: str) -> float:
        return statistics.median(r[key] for r in later)

    step_s = median("timing/step_s")
    return {"step_s": step_s, "tokens_per_s": median("throughput/tokens_per_s"),
            "reward_first10": statistics.mean(r["reward/mean"] for r in records[:10]),
            "reward_last10": statistics.mean(r["reward/mean"] for r in records[-10:]),
            **{k: median(k) for k in records[-1] if k.startswith("busy/")},
            **{k: v for k, v in records[-1].items() if k.startswith("pipeline/version_lag")}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--reward-delay", type=float, default=None, help="seconds per Score call (default: calibrated)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "model", task="addition", warm_start_steps=150)
    runs = Path(tempfile.mkdtemp())
    delay = args.reward_delay
    if delay is None:  # the actor's time per step, alone
        calibration = up(model, runs, "calibrate", 8)[2:]
        delay = statistics.median(r["timing/step_s"] for r in calibration)
    results: dict = {"reward_delay_s": delay, "max_staleness": args.max_staleness}
    results["sync"] = summary(up(model, runs, "sync", args.steps, f"reward.score_delay_s={delay}"))
    results["async"] = summary(up(model, runs, "async", args.steps, f"reward.score_delay_s={delay}",
                                  "pipeline.mode=async", f"pipeline.max_staleness={args.max_staleness}"))
    results["async_over_sync"] = results["async"]["tokens_per_s"] / results["sync"]["tokens_per_s"]
    print(json.dumps(results, indent=2), flush=True)
    (out / "pipeline.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

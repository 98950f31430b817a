#!/usr/bin/env bash
# Runs the CPU demo once per algorithm (200 steps each, real role processes via `rolefleet up`) and
# prints, per algorithm: steps, mean reward over the first 10 and last 10 steps, median step time.
# Usage: benchmarks/demo_algorithms.sh   (after `make demo` has built runs/demo-model)
set -euo pipefail
cd "$(dirname "$0")/.."
RF=.venv/bin/rolefleet
run() {  # name config [overrides...]
  local name=$1 config=$2; shift 2
  "$RF" up "configs/$config" "$@" "run.name=bench-$name" > /dev/null
  .venv/bin/python - "$name" <<'PY'
import json, statistics, sys
name = sys.argv[1]
r = [json.loads(line) for line in open(f"runs/bench-{name}/metrics.jsonl")]
first = sum(x["reward/mean"] for x in r[:10]) / 10
last = sum(x["reward/mean"] for x in r[-10:]) / 10
step_s = statistics.median(x["timing/step_s"] for x in r)
print(f"{name:<22} steps {len(r)}  reward first10 {first:.3f}  last10 {last:.3f}  median step {step_s:.3f}s")
PY
}
run ppo demo.yaml
for algo in grpo rloo drgrpo reinforce_pp reinforce_pp_baseline; do
  run "$algo" demo_grpo.yaml "algorithm=$algo"
done

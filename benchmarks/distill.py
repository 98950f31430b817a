"""On-policy distillation against RL from the same start (docs/benchmarks.md, "On-policy
distillation"): GRPO trains a teacher from a model (`configs/smollm2_arithmetic.yaml`'s task and
reward by default, SmolLM2-135M-Instruct from `make real-model`), its last checkpoint is exported,
and the same starting model is then distilled from it (`algorithm: distill`, the teacher role)
through `rolefleet up`. Both runs evaluate greedily on the same held-out prompts every
`--eval-every` steps.

The target's question: the steps each needs to reach the teacher's final held-out accuracy within
`--within` (2 points); distillation should need at most a third of GRPO's.

    python benchmarks/distill.py --model runs/smollm2-135m-instruct --out OUT [--grpo-steps 60] [--distill-steps 20] \\
        [--distill-lrs 1e-5 3e-5] [--distill-samples N]
    python benchmarks/distill.py --config configs/demo.yaml --model runs/demo-model --out OUT \\
        --grpo-steps 6 --distill-steps 4 --eval-every 2 --set devices=cpu      # a CPU smoke run

Prints one JSON line per part and writes OUT/distill.json: each run's eval curve (step, pass@1),
median seconds a step, the teacher's final accuracy, the first eval step at which each run reaches
it within `--within`, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def up(args, name: str, out: Path, *overrides: str) -> list[dict]:
    """`rolefleet up` of the config with the shared workload and `overrides`; its metrics records."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", args.config, f"model.model_name_or_path={args.model}",
           f"eval.every={args.eval_every}", f"eval.max_prompts={args.eval_prompts}", "eval.temperature=0.0",
           f"train.prompts_per_step={args.prompts_per_step}", f"run.output_dir={run_dir}", *overrides, *args.set]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/pass@1"]) for r in records if "eval/pass@1" in r]


def step_s(records: list[dict]) -> float | None:
    steps = [r["timing/step_s"] for r in records if "timing/step_s" in r]
    return statistics.median(steps[1:] or steps) if steps else None


def first_reaching(points: list[tuple[int, float]], accuracy: float) -> int | None:
    return next((step for step, value in points if value >= accuracy), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the starting model of both runs (the student)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/smollm2_arithmetic.yaml")
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--distill-steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="GRPO's group size")
    parser.add_argument("--distill-samples", type=int, default=None,
                        help="samples per prompt of the distillation run (default GRPO's: steps of equal size)")
    parser.add_argument("--distill-lrs", type=float, nargs="+", default=[1e-5],
                        help="one distillation run per learning rate, each against the same GRPO teacher")
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--distill-set", nargs="*", default=[],
                        help="key=value overrides of the distillation runs alone (teacher.top_k=16 "
                             "actor.teacher_kl_coef=1.0: the teacher's top-k term)")
    parser.add_argument("--teacher", default=None,
                        help="an exported teacher of an earlier call (its GRPO run's curve in its directory's "
                             "grpo.json): skips the GRPO run")
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides of both runs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.teacher:
        teacher = Path(args.teacher)
        grpo_part = json.loads((teacher / "grpo.json").read_text())
    else:
        grpo = up(args, "grpo", out, "algorithm=grpo", f"train.total_steps={args.grpo_steps}",
                  f"train.samples_per_prompt={args.samples_per_prompt}", "checkpoint.at_end=true")
        checkpoint = max((out / "grpo" / "checkpoints").glob("step-*"))
        teacher = out / "teacher"
        subprocess.run([sys.executable, "-m", "rolefleet.cli", "export", str(checkpoint), str(teacher)], check=True)
        grpo_part = {"curve": curve(grpo), "step_s": step_s(grpo)}
        (teacher / "grpo.json").write_text(json.dumps(grpo_part))
    grpo_curve = [tuple(point) for point in grpo_part["curve"]]
    accuracy = grpo_curve[-1][1]
    print(json.dumps({"part": "grpo", **grpo_part}), flush=True)

    goal = accuracy - args.within
    grpo_steps = first_reaching(grpo_curve, goal)
    samples = args.distill_samples or args.samples_per_prompt
    runs = []
    for lr in args.distill_lrs:
        records = up(args, f"distill-lr{lr:g}", out, "algorithm=distill", f"teacher.model_name_or_path={teacher}",
                     f"train.total_steps={args.distill_steps}", f"train.samples_per_prompt={samples}",
                     f"actor.lr={lr}", "checkpoint.at_end=false", *args.distill_set)
        points = curve(records)
        steps = first_reaching(points, goal)
        runs.append({"lr": lr, "samples_per_prompt": samples, "curve": points, "step_s": step_s(records),
                     "steps_to_goal": steps, "steps_ratio": steps / grpo_steps if grpo_steps and steps else None,
                     "reverse_kl": [r["distill/reverse_kl"] for r in records if "distill/reverse_kl" in r],
                     "teacher_kl": [r["actor/teacher_kl"] for r in records if "actor/teacher_kl" in r]})
        print(json.dumps({"part": "distill", **{k: v for k, v in runs[-1].items() if k not in ("reverse_kl", "teacher_kl")}}), flush=True)

    # A start already at the goal (step 0's eval) makes the comparison empty: both then read 0 steps.
    result = {"start_accuracy": grpo_curve[0][1] if grpo_curve else None, "teacher_accuracy": accuracy, "goal": goal,
              "grpo_steps_to_goal": grpo_steps,
              "distill_steps_to_goal": [run["steps_to_goal"] for run in runs],
              "steps_ratio": [run["steps_ratio"] for run in runs],
              "distill_set": args.distill_set, "grpo": grpo_part, "distill": runs}
    (out / "distill.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("grpo", "distill")}), flush=True)


if __name__ == "__main__":
    main()

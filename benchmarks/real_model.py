"""A real chat model, side by side: GRPO of a model directory (SmolLM2-135M-Instruct from `make
real-model`) on `configs/smollm2_arithmetic.yaml`'s task through `rolefleet up` on GPU 0, and the
same model, prompts (the same batch of each step), reward (`math`), batch, learning rate and step
count through TRL's GRPOTrainer; both evaluated by the project's own evaluation (greedy, the same
held-out prompts): RoleFleet's during its run, TRL's checkpoint after its run, through the same
engine and reward code in this process.

    python benchmarks/real_model.py --model runs/smollm2-135m-instruct --out OUT [--steps 60] [--parts rolefleet,trl]
    python benchmarks/real_model.py --model runs/smollm2-135m-instruct --out OUT --sweep [32x64 128x256 ...]

Prints one JSON line per part and writes OUT/real_model.json: seconds per step (median after the
first `--warmup` steps), generated tokens per second of step time, the eval curve (step, held-out
accuracy), the eval's time against a step's, and the ratios. TRL needs trl and datasets (not
RoleFleet dependencies; carried to the GPU machine as wheels).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "configs/smollm2_arithmetic.yaml"


def gpu_settings(compile_layers: bool = True) -> tuple[str, ...]:
    """GPU 0 (the config's) and the one-GPU settings of configs/gpu_1x.yaml; the CPU on a machine
    without CUDA (a smoke run of the script)."""
    import torch

    if not torch.cuda.is_available():
        return ("devices=cpu",)
    return ("actor.rollout.backend=hf", f"actor.compile_layers={str(compile_layers).lower()}",
            "actor.max_tokens_per_micro_batch=32768")


def spread(seconds: list[float], warmup: int) -> dict:
    """The steps after `warmup`: p95 step time, and the steps after the third slower than 1.5x the
    median (a stall: a compile, a cache rebuilt mid-run), by step number."""
    later = sorted(seconds[warmup:] or seconds)
    median = statistics.median(later)
    return {"step_s_p95": later[min(len(later) - 1, int(0.95 * len(later)))],
            "stalls": [[i + 1, round(s, 3)] for i, s in enumerate(seconds) if i >= 3 and s > 1.5 * median]}


def workload(args) -> list[str]:
    return [f"model.model_name_or_path={args.model}", f"train.total_steps={args.steps}",
            f"train.prompts_per_step={args.prompts_per_step}", f"train.samples_per_prompt={args.samples_per_prompt}",
            f"sampling.max_new_tokens={args.max_new_tokens}", f"actor.lr={args.lr}", f"eval.every={args.eval_every}",
            f"eval.max_prompts={args.eval_prompts}", *args.set]


def run_rolefleet(args, out: Path) -> dict:
    run_dir = out / "rolefleet"
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", CONFIG, *workload(args), *gpu_settings(),
           f"run.output_dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rolefleet: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/step_s" in r]
    later = steps[args.warmup:] or steps
    tokens = [r["response_length/mean"] * args.prompts_per_step * args.samples_per_prompt for r in later]
    evals = [r for r in records if "eval/pass@1" in r]
    step_s = statistics.median(r["timing/step_s"] for r in later)
    return {
        "part": "rolefleet", "wall_s": time.perf_counter() - start, "steps": len(steps), "step_s": step_s,
        **spread([r["timing/step_s"] for r in steps], args.warmup),
        "generate_s": statistics.median(r["timing/generate_s"] for r in later),
        "update_s": statistics.median(r["timing/update_s"] for r in later),
        "tokens_per_s": statistics.median(t / r["timing/step_s"] for t, r in zip(tokens, later)),
        "response_length": statistics.median(r["response_length/mean"] for r in later),
        "clip_ratio": statistics.median(r["response_length/clip_ratio"] for r in later),
        "reward_first10": statistics.mean(r["reward/mean"] for r in steps[:10]),
        "reward_last10": statistics.mean(r["reward/mean"] for r in steps[-10:]),
        "eval_curve": [[r["step"], r["eval/pass@1"]] for r in evals],
        "eval_s": statistics.median(r["eval/time_s"] for r in evals),
        "eval_response_length": [[r["step"], r["eval/response_length/mean"]] for r in evals],
        "eval_s_over_step_s": statistics.median(r["eval/time_s"] for r in evals) / step_s,
        "stall_phases": stall_phases(steps, args.warmup),
    }


def stall_phases(steps: list[dict], warmup: int) -> list[dict]:
    """Each stall's step as its record tells it: the phases' seconds and what compiled or was
    rebuilt in it (a stall is then attributed without the run's metrics file)."""
    stalled = {n for n, _ in spread([r["timing/step_s"] for r in steps], warmup)["stalls"]}
    keys = ("compile/graphs", "compile/seconds", "actor/decode_shapes_built", "checkpoint/snapshot_s")
    return [{"step": r["step"], **{k: round(v, 3) for k, v in r.items() if k.startswith("timing/") or k in keys}}
            for i, r in enumerate(steps, start=1) if i in stalled]


def trl_prompts(args) -> tuple[list[str], list[str]]:
    """Step by step, the prompts (rendered with the chat template) RoleFleet's run trains on."""
    from rolefleet.common.config import load_config
    from rolefleet.coordinator.data import PromptDataset

    cfg = load_config(CONFIG, workload(args))
    dataset = PromptDataset.for_run(cfg)
    records = [r for step in range(1, args.steps + 1) for r in dataset.batch(step, args.prompts_per_step)]
    return [r.prompt for r in records], [r.ground_truth for r in records]


def run_trl(args, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rolefleet.reward.math_answers import math_reward

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.lengths = [], []

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)

        def on_log(self, args_, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    def correct(completions, ground_truth, **kwargs) -> list[float]:
        return [math_reward("", c, g, {}) for c, g in zip(completions, ground_truth)]

    prompts, truths = trl_prompts(args)
    completions = args.prompts_per_step * args.samples_per_prompt
    micro = min(64, completions)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        beta=0.0, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(), num_generations=args.samples_per_prompt, max_completion_length=args.max_new_tokens,
        temperature=1.0, per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        logging_steps=1, report_to="none", save_strategy="no", shuffle_dataset=False, seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=args.model, reward_funcs=correct, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts, "ground_truth": truths}),
                          callbacks=[timer])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    final = out / "trl-model"
    trainer.save_model(str(final))
    trainer.processing_class.save_pretrained(str(final))
    del trainer
    torch.cuda.empty_cache()
    later = list(zip(timer.seconds, timer.lengths))[args.warmup:]
    step_s = statistics.median(s for s, _ in later)
    return {"part": "trl", "wall_s": wall, "steps": len(timer.seconds), "step_s": step_s,
            **spread(timer.seconds, args.warmup),
            "tokens_per_s": statistics.median(n * completions / s for s, n in later),
            "response_length": statistics.median(n for _, n in later),
            "final_eval": evaluate(args, final)}


def evaluate(args, model_dir: Path) -> dict:
    """The project's evaluation of a model directory: the run's held-out prompts, greedy, through
    an actor core's rollout engine and the reward core, in this process."""
    from rolefleet.actor.client import InProcessActorClient
    from rolefleet.actor.core import ActorCore
    from rolefleet.common.config import load_config
    from rolefleet.coordinator.data import PromptDataset
    from rolefleet.coordinator.evaluation import Evaluator
    from rolefleet.reward.client import InProcessRewardClient
    from rolefleet.reward.core import RewardCore

    # No compile: one evaluation would pay tens of seconds of compiling for nothing.
    cfg = load_config(CONFIG, [*workload(args), *gpu_settings(compile_layers=False),
                               f"model.model_name_or_path={model_dir}", f"run.output_dir={tempfile.mkdtemp()}"])
    actor, reward = InProcessActorClient(ActorCore(cfg.actor)), InProcessRewardClient(RewardCore(cfg.reward))
    evaluator = Evaluator.for_run(cfg, PromptDataset.for_run(cfg))
    return asyncio.run(evaluator.run(args.steps, actor.generate, reward.score))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a model directory (make real-model)")
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="rolefleet,trl")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of both runs")
    p.add_argument("--sweep", nargs="*", default=None, metavar="PROMPTSxTOKENS",
                   help="run the comparison at each point (prompts per step x new tokens, e.g. 32x64 128x256; "
                        "no value: the issue's grid 32x64 64x64 128x64 32x256 64x256 128x256) into OUT/<point>/, "
                        "and a table of them all")
    args = p.parse_args()
    if args.sweep is not None:
        return sweep(args)
    compare(args, Path(args.out))


SWEEP = ["32x64", "64x64", "128x64", "32x256", "64x256", "128x256"]


def sweep(args) -> None:
    """`compare` at every point of the grid, one after another in this call; OUT/sweep.json's table:
    each side's median and p95 step time, its stalls, the steps-per-second ratio and both held-out
    accuracies."""
    table = []
    for point in args.sweep or SWEEP:
        prompts, tokens = (int(x) for x in point.split("x"))
        results = compare(argparse.Namespace(**{**vars(args), "prompts_per_step": prompts, "max_new_tokens": tokens}),
                          Path(args.out) / point)
        row = {"point": point}
        for part in ("rolefleet", "trl"):
            if part in results:
                r = results[part]
                row[part] = {"step_s": r["step_s"], "step_s_p95": r["step_s_p95"], "stalls": r["stalls"],
                             **({"stall_phases": r["stall_phases"]} if "stall_phases" in r else {})}
        if "ratio" in results:
            row.update(results["ratio"])
        table.append(row)
        print(json.dumps({"sweep": row}), flush=True)
    (Path(args.out) / "sweep.json").write_text(json.dumps(table, indent=2))


def compare(args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for part in args.parts.split(","):
        results[part] = {"rolefleet": run_rolefleet, "trl": run_trl}[part](args, out)
        print(json.dumps(results[part]), flush=True)
    if {"rolefleet", "trl"} <= set(results):
        rf, trl = results["rolefleet"], results["trl"]
        results["ratio"] = {"steps_per_s": trl["step_s"] / rf["step_s"],
                            "tokens_per_s": rf["tokens_per_s"] / trl["tokens_per_s"],
                            "final_accuracy_rolefleet": rf["eval_curve"][-1][1],
                            "final_accuracy_trl": trl["final_eval"]["eval/pass@1"]}
        print(json.dumps(results["ratio"]), flush=True)
    (out / "real_model.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

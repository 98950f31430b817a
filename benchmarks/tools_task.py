"""A real chat model learns to use a calculator (docs/benchmarks.md, "Multi-turn tool use"):
SmolLM2-135M-Instruct (`make real-model`) on `tool_arithmetic` (3-4 digit + - *), one GPU.

1. base: the model as it is, evaluated (greedy, multi-turn, 200 held-out prompts): how often it
   calls the calculator, how often its final answer is right.
2. warm start: `--warm-start-steps` supervised steps (configs/tools_warm_start.yaml, `algorithm:
   sft` through `rolefleet up`, exported) on conversations of which 3 in 10 call the calculator
   (the others answer at once): the model learns the call format, and that it may answer without it.
3. RL: GRPO through `rolefleet up configs/gpu_tools.yaml` from the warm-started model, evaluated
   before its first step and every 10 steps (`eval/pass@1`, `eval/episode/tool_use_rate`), once
   for each of `--ways`: `env`, the reward role's built-in `tools` environment; `agent`, the same
   task driven by an agent written against the `openai` client
   (`examples/agents/calculator_agent.py`, the same calculator schema) through the actor's
   OpenAI-compatible endpoint, scored by the same `math` reward.

    python benchmarks/tools_task.py --model runs/smollm2-135m-instruct --out OUT [--ways env agent]

Writes OUT/tools_task.json: the three phases' tool-use rate and held-out accuracy, each RL run's eval
curve and median step time, and the agent's step time over the environment's. Without CUDA it runs as a smoke test of itself (use a tiny chat
model and small --steps).
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

CONFIG = "configs/gpu_tools.yaml"
WARM_CONFIG = "configs/tools_warm_start.yaml"
REPO = Path(__file__).resolve().parents[1]
# The agent way: no environment of the reward role's; the example agent drives the episodes and
# leaves the scoring to the config's `math` source, as the environment's runs do.
WAYS = {"env": [], "agent": ["reward.env.name=null", f"reward.agent.path={REPO}/examples/agents/calculator_agent.py:agent",
                             "reward.agent.options={score: false}", "reward.agent.workers=4"]}


def settings(args, model: str) -> list[str]:
    import torch

    gpu = [] if torch.cuda.is_available() else ["devices.actor=[]", "actor.compute_dtype=float32"]
    return [f"model.model_name_or_path={model}", f"train.total_steps={args.steps}",
            f"train.prompts_per_step={args.prompts_per_step}", f"train.samples_per_prompt={args.samples_per_prompt}",
            f"eval.max_prompts={args.eval_prompts}", f"actor.lr={args.lr}", *gpu, *args.set]


def evaluate(args, model: str) -> dict:
    """The run's evaluation of a model directory, in this process: the held-out prompts, greedy,
    whole conversations with the tools environment."""
    from rolefleet.actor.client import InProcessActorClient
    from rolefleet.actor.core import ActorCore
    from rolefleet.common.config import load_config
    from rolefleet.coordinator.data import PromptDataset
    from rolefleet.coordinator.episodes import EpisodeStage
    from rolefleet.coordinator.evaluation import Evaluator
    from rolefleet.reward.client import InProcessRewardClient
    from rolefleet.reward.core import RewardCore

    cfg = load_config(CONFIG, [*settings(args, model), f"run.output_dir={tempfile.mkdtemp()}"])
    actor_core, reward_core = ActorCore(cfg.actor), RewardCore(cfg.reward)
    try:
        actor, reward = InProcessActorClient(actor_core), InProcessRewardClient(reward_core)
        evaluator = Evaluator.for_run(cfg, PromptDataset.for_run(cfg))
        episodes = EpisodeStage(cfg, actor, reward)

        async def generate(prompts, sampling, first_group_id=0):
            return await episodes.generate(evaluator.records, sampling, first_group_id)

        return asyncio.run(evaluator.run(0, generate, reward.score))
    finally:
        reward_core.close()
        actor_core.close()


def warm_start(args, out: Path) -> Path:
    """The supervised warm start as configs/tools_warm_start.yaml runs it (`algorithm: sft` through
    `rolefleet up`), its last checkpoint exported as the RL runs' model."""
    import torch

    run_dir = out / "warm-start"
    cpu = [] if torch.cuda.is_available() else ["devices.actor=[]"]
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", WARM_CONFIG, f"model.model_name_or_path={args.model}",
           f"train.total_steps={args.warm_start_steps}", f"train.prompts_per_step={args.warm_start_batch}",
           f"actor.lr={args.warm_start_lr}", f"eval.max_prompts={args.eval_prompts}",
           f"eval.every={args.warm_start_steps}", "eval.before_train=false", f"run.output_dir={run_dir}",
           "checkpoint.at_end=true", "checkpoint.every_minutes=0", *cpu]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"warm start: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    target = out / "warm-model"
    checkpoint = max((run_dir / "checkpoints").glob("step-*"))
    subprocess.run([sys.executable, "-m", "rolefleet.cli", "export", str(checkpoint), str(target)], check=True,
                   capture_output=True)
    steps = [r for r in records if "sft/loss" in r]
    print(json.dumps({"warm_start_loss": steps[-1]["sft/loss"], "warm_start_step_s":
                      statistics.median(r["timing/step_s"] for r in steps)}), flush=True)
    return target


def phase(record: dict) -> dict:
    return {"accuracy": record["eval/pass@1"], "tool_use_rate": record.get("eval/episode/tool_use_rate", 0.0),
            "turns": record.get("eval/episode/turns/mean", 1.0), "tool_errors": record.get("eval/episode/tool_errors/mean", 0.0)}


def run_rl(args, model: Path, out: Path, way: str) -> dict:
    run_dir = out / f"rl-{way}"
    # The way's settings first: `--set` may change them (the agent workers, say).
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", CONFIG, *WAYS[way], *settings(args, str(model)),
           f"run.output_dir={run_dir}", "checkpoint.at_end=false", "checkpoint.every_minutes=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rolefleet: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/pass@1" in r]
    steps = [r for r in records if "timing/step_s" in r]
    return {"before": phase(evals[0]), "after": phase(evals[-1]),
            "curve": [[r["step"], r["eval/pass@1"], r.get("eval/episode/tool_use_rate", 0.0)] for r in evals],
            "train_tool_use_rate": [[r["step"], r["episode/tool_use_rate"]] for r in steps],
            "step_s": statistics.median(r["timing/step_s"] for r in steps),
            # The actor's memory after each update and its peak during it (GiB, on CUDA): a leak grows the first.
            "actor_memory_gib": [[r["step"], round(r["actor/memory_gib"], 2), round(r["actor/peak_memory_gib"], 2)]
                                 for r in steps if "actor/memory_gib" in r]}


def release_device() -> None:
    """This process's cached GPU memory back to the device before the runs' roles need it (the
    base model's evaluation and the warm start leave gigabytes in PyTorch's cache otherwise)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a chat model directory (make real-model)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--warm-start-steps", type=int, default=40)
    p.add_argument("--warm-start-batch", type=int, default=32)
    p.add_argument("--warm-start-lr", type=float, default=1e-4)
    p.add_argument("--ways", nargs="+", default=["env", "agent"], choices=sorted(WAYS),
                   help="RL runs from the same warm start: the built-in environment, the openai-client agent")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of the RL runs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {"base": phase(evaluate(args, args.model))}
    print(json.dumps({"base": results["base"]}), flush=True)
    warm = warm_start(args, out)
    release_device()
    for way in args.ways:
        rl = run_rl(args, warm, out, way)
        results[way] = {"warm_start": rl["before"], "after_rl": rl["after"], "curve": rl["curve"],
                        "train_tool_use_rate": rl["train_tool_use_rate"], "step_s": rl["step_s"],
                        "actor_memory_gib": rl["actor_memory_gib"]}
        print(json.dumps({way: {k: results[way][k] for k in ("warm_start", "after_rl", "step_s")}}), flush=True)
    if "env" in results and "agent" in results:
        results["agent_step_over_env"] = results["agent"]["step_s"] / results["env"]["step_s"]
    results.update(wall_s=time.perf_counter() - start, settings=vars(args))
    print(json.dumps({k: results.get(k) for k in ("agent_step_over_env", "wall_s")}), flush=True)
    (out / "tools_task.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

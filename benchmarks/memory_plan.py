"""The memory planner (`rolefleet plan`, `app/memory.py`) against measured peaks on a GPU, and the
step's phases: the actor of a one-GPU config (GRPO, every role on GPU 0) in-process, on random
weights of real dimensions: generate (prompts_per_step x samples_per_prompt x max_new_tokens),
ComputeLogProbs (policy and reference) and an update, `--steps` times (the last is the warm one);
each run in a process of its own, so its peaks are its own.

    python benchmarks/memory_plan.py --out OUT [--shapes qwen2-0.5b,qwen2-1.5b] [--variants default,eager]
    python benchmarks/memory_plan.py --out OUT --runs qwen2-1.5b:default,qwen2.5-7b:lora,qwen2.5-7b:full-offload

Per phase: torch's peak allocated and reserved bytes and seconds, and the planner's estimate of the
same phase (held + phase, with the allocator slack and CUDA context of `app/memory.py`); the warm
step's time (the last step's generate + logprobs + update) and the update's model FLOP rate and MFU (6 x params x
tokens for full-parameter training, 4 x params x tokens with LoRA, whose backward computes no weight
gradients; an H200's 989 dense bf16 TFLOP/s); OUT/memory_plan.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PEAK_FLOPS = 989e12  # an H200's dense bf16 rate
VARIANTS = {  # name: (config, overrides)
    "default": ("gpu_1x.yaml", []),  # gpu_1x as shipped: compiled layers, 32768-token micro-batches
    "eager": ("gpu_1x.yaml", ["actor.compile_layers=false", "actor.max_tokens_per_micro_batch=8192"]),
    "checkpointing": ("gpu_1x.yaml", ["actor.compile_layers=false", "actor.gradient_checkpointing=true"]),
    "offload-optimizer": ("gpu_1x.yaml", ["actor.offload=optimizer"]),
    "offload-params": ("gpu_1x.yaml", ["actor.offload=params"]),
    "lora": ("gpu_7b.yaml", []),  # gpu_7b as shipped: LoRA r=32 on every linear layer
    # gpu_7b's full-parameter variant (its header): optimizer state and reference in host memory.
    "full-offload": ("gpu_7b.yaml", ["actor.lora.rank=0", "actor.offload=optimizer", "actor.ref_offload=true",
                                     "actor.gradient_checkpointing=true", "actor.max_tokens_per_micro_batch=16384"]),
}


def measure(model: str, variant: str, steps: int = 2, profile_dir: str | None = None) -> dict:
    """In this process: the actor's phases and their peaks, and the planner's estimate."""
    import torch

    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.types import PolicyTargets, SamplingParams
    from rolefleet.app.memory import ALLOCATOR_SLACK, CUDA_CONTEXT, GIB, gpu_capacity, plan
    from rolefleet.common.batch import SequenceBatch
    from rolefleet.common.config import load_config
    from rolefleet.tasks import make_task

    config, overrides = VARIANTS[variant]
    if profile_dir:  # a third update under torch.profiler, after the measured ones
        overrides = [*overrides, f"actor.profile_updates=[{steps + 1}]", f"actor.profile_dir={profile_dir}"]
    cfg = load_config(CONFIGS / config, [f"model.model_name_or_path={model}", *overrides])
    [gpu] = plan(cfg, gpu_capacity())
    est = next(e for e in gpu.estimates if e.role == "actor")
    held = sum(p.bytes for p in est.held)
    estimate = {phase: ((held + sum(p.bytes for p in parts)) * ALLOCATOR_SLACK + CUDA_CONTEXT) / GIB
                for phase, parts in est.phases.items()}
    core = ActorCore(cfg.actor, seed=0)
    t = cfg.train
    prompts = [r.prompt for r in make_task("addition", size=t.prompts_per_step, seed=0)]
    sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, n=t.samples_per_prompt, seed=1)
    out: dict = {"estimate_gib": estimate, "estimate_total_gib": est.total / GIB, "phases": {}}

    def phase(name, fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        out["phases"][name] = {"allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                               "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
                               "seconds": time.perf_counter() - start}
        return result

    stats = []
    for step in range(1, steps + 1):
        suffix = "" if step == 1 else str(step)
        samples = phase(f"generate{suffix}", lambda: core.generate(prompts, sampling))
        batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        lp = phase(f"logprobs{suffix}", lambda batch=batch: core.compute_logprobs(batch, 1.0, include_reference=True))
        targets = PolicyTargets(torch.randn(batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
        stats.append(phase(f"update{step}", lambda step=step, batch=batch, targets=targets:
                           core.update(step, step - 1, batch, targets, 1.0)).stats)
    if profile_dir:
        core.update(steps + 1, steps, batch, targets, 1.0)
    warm = {name: out["phases"][f"{name}{steps}"]["seconds"] for name in ("generate", "logprobs", "update")}
    tokens = int(batch.prompt_lengths.sum() + batch.response_lengths.sum())
    flops = (4 if cfg.actor.lora.enabled else 6) * core.worker.trainer.model.num_parameters() * tokens
    out.update(response_tokens=batch.num_response_tokens, tokens=tokens, step_s=sum(warm.values()),
               update_tflops=flops / warm["update"] / 1e12, update_mfu=flops / warm["update"] / PEAK_FLOPS,
               compiled_graphs=[s.get("compiled_graphs") for s in stats],
               peak_allocated_gib=max(p["allocated_gib"] for p in out["phases"].values()),
               peak_reserved_gib=max(p["reserved_gib"] for p in out["phases"].values()))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen2-0.5b,qwen2-1.5b")
    p.add_argument("--variants", default="default,eager,checkpointing,offload-optimizer,offload-params")
    p.add_argument("--runs", help="SHAPE:VARIANT,... instead of every shape with every variant")
    p.add_argument("--timeout", type=float, default=150, help="seconds per run")
    p.add_argument("--steps", type=int, default=2, help="steps of each run; the last is the warm one timed")
    p.add_argument("--profile", action="store_true", help="one more update of each run under torch.profiler "
                   "(its op table in OUT/profiles)")
    p.add_argument("--model-dir", help="where the random-weight models are built, or found from an earlier call "
                   "(default: a temporary directory)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args()
    out = Path(args.out)
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.steps, str(out / "profiles") if args.profile else None)))
        return
    import torch

    from rolefleet.app.tiny_model import make_tiny_model

    runs = ([tuple(run.split(":")) for run in args.runs.split(",")] if args.runs else
            [(shape, variant) for shape in args.shapes.split(",") for variant in args.variants.split(",")])
    results, models = [], {}
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or tempfile.mkdtemp())
    for shape, variant in runs:
        if shape not in models:  # built on the GPU (seconds at 7B, minutes on the CPU), saved in bf16
            models[shape] = model_dir / shape
            if not (models[shape] / "tokenizer_config.json").exists():  # written last: a whole earlier build
                with torch.device("cuda"):
                    make_tiny_model(models[shape], shape=shape, dtype=torch.bfloat16)
                torch.cuda.empty_cache()
        row = {"shape": shape, "variant": variant}
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(out), "--one", str(models[shape]), variant,
                                   "--steps", str(args.steps), *(["--profile"] if args.profile else [])],
                                  capture_output=True, text=True, timeout=args.timeout)
            lines = done.stdout.strip().splitlines()
            row.update(json.loads(lines[-1]) if done.returncode == 0 and lines else
                       {"error": done.stderr.strip().splitlines()[-3:]})
        except subprocess.TimeoutExpired:
            row["error"] = f"over {args.timeout} s"
        print(json.dumps(row), flush=True)
        results.append(row)
        (out / "memory_plan.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

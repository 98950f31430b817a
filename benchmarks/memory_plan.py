"""The memory planner (`rolefleet plan`, `app/memory.py`) against measured peaks on a GPU: the actor
of `configs/gpu_1x.yaml` (GRPO, every role on GPU 0) in-process, on random weights of real
dimensions, one generate (prompts_per_step x samples_per_prompt x max_new_tokens), one
ComputeLogProbs and two updates; each variant in a process of its own, so its peaks are its own.

    python benchmarks/memory_plan.py --out OUT [--shapes qwen2-0.5b,qwen2-1.5b] [--variants default,eager]

Per phase: torch's peak allocated and reserved bytes and the planner's estimate of the same phase
(held + phase, with the allocator slack and CUDA context of `app/memory.py`); OUT/memory_plan.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpu_1x.yaml"
VARIANTS = {
    "default": [],  # gpu_1x as shipped: compiled layers, 32768-token micro-batches
    "eager": ["actor.compile_layers=false", "actor.max_tokens_per_micro_batch=8192"],
    "checkpointing": ["actor.compile_layers=false", "actor.gradient_checkpointing=true"],
    "offload-optimizer": ["actor.offload=optimizer"],
    "offload-params": ["actor.offload=params"],
}


def measure(model: str, overrides: list[str]) -> dict:
    """In this process: the actor's phases and their peaks, and the planner's estimate."""
    import torch

    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.types import PolicyTargets, SamplingParams
    from rolefleet.app.memory import ALLOCATOR_SLACK, CUDA_CONTEXT, GIB, gpu_capacity, plan
    from rolefleet.common.batch import SequenceBatch
    from rolefleet.common.config import load_config
    from rolefleet.tasks import make_task

    cfg = load_config(CONFIG, [f"model.model_name_or_path={model}", *overrides])
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

    samples = phase("generate", lambda: core.generate(prompts, sampling))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    out["response_tokens"] = batch.num_response_tokens
    lp = phase("logprobs", lambda: core.compute_logprobs(batch, 1.0, include_reference=True))
    targets = PolicyTargets(torch.randn(batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
    for step in (1, 2):
        phase(f"update{step}", lambda step=step: core.update(step, step - 1, batch, targets, 1.0))
        if step == 1:
            phase("generate2", lambda: core.generate(prompts, sampling))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen2-0.5b,qwen2-1.5b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=150, help="seconds per variant")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], VARIANTS[args.one[1]])))
        return
    from rolefleet.app.tiny_model import make_tiny_model

    out, results = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        model = make_tiny_model(Path(tempfile.mkdtemp()) / shape, shape=shape)
        for variant in args.variants.split(","):
            row = {"shape": shape, "variant": variant}
            try:
                done = subprocess.run([sys.executable, __file__, "--out", str(out), "--one", str(model), variant],
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

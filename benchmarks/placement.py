"""Placement on two GPUs: the same PPO workload (Qwen2-0.5B dimensions for actor and critic, random
weights, 64 prompts x 4 samples x 256 new tokens per step) under several `devices:` maps and
pipeline modes (`--runs`, any of):

- colocated: `configs/2gpu_colocated.yaml`, every role over both GPUs (two workers each), sync;
- split / split_async: `configs/2gpu.yaml`, actor on GPU 0, critic on GPU 1, sync / async;
- rollout_async: `configs/2gpu_rollout.yaml`, the actor generating on GPU 0 and training on GPU 1
  (weights broadcast after each update), the critic over both GPUs, async in eager order;
- rollout_async_stream / _stale2 / _vllm: the same with 64-sequence engine calls (each streams as it
  finishes), with `pipeline.max_staleness: 2`, and with vLLM generating;
- rollout_async_threads16 / _recompute (and grpo_rollout_async_recompute): the same with the
  coordinator on 16 torch threads, and with old logprobs in a pass of their own before each update;
- grpo_colocated / grpo_rollout_async: GRPO (no critic) in the colocated and the rollout-apart maps;
- grpo_rollout_async_torch_threads / rollout_async_torch_threads: the GPU roles on torch's default CPU
  threads (one per core, their default before) instead of one (`<role>.num_threads`);
- rollout_critic0: the same with the critic on GPU 0 beside the engine (the config's map before
  2026-11-30, eighth session); rollout_critic1 / _exact / _sync: with the critic on GPU 1 beside the
  trainer, async eager / async exact / sync.

Prints seconds per step, generated tokens per second of step time, each GPU's NVML busy fraction
during the run (`gpu_busy_per_gpu`, and `gpu_busy_per_gpu_steady` without the steps whose update
recompiled, listed in `recompiles`), and the ratios to colocated sync when it ran in the same
call; each run's role calls on a timeline (`run.call_trace`) go to OUT/traces/<run>.trace.json;
with `--parts scaling`, the actor's update phase (GRPO) on two GPUs, FSDP2-sharded and
replicated, against one GPU (scaling efficiency).

    python benchmarks/placement.py --out OUT_DIR [--steps 10 --warmup 3] [--parts placement,scaling] [--runs colocated,rollout_async]
    python benchmarks/placement.py --out OUT_DIR --parts scaling --sharding fsdp --profile-update 6
    python benchmarks/placement.py --out OUT_DIR --runs grpo_rollout_async --steps 12 --profile-update 11

Needs two GPUs (nvidia-h200-x2); the node8_* runs eight, the node4_* runs four. Medians and busy time over the steps after the first `--warmup`
(torch.compile recompiles for new shapes during the first few steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from gpu_e2e import count_parameters, measured_until, run

from rolefleet.app.tiny_model import make_tiny_model

ASYNC = ("pipeline.mode=async", "pipeline.max_staleness=1")
TORCH_THREADS = torch.get_num_threads()  # torch's default on this host (nothing has set it yet)
RUNS = {  # name: (config, overrides)
    "colocated": ("configs/2gpu_colocated.yaml", ()),
    "split": ("configs/2gpu.yaml", ()),
    "split_async": ("configs/2gpu.yaml", ASYNC),
    # The actor generating on GPU 0 and training on GPU 1; the critic over both (the config's), on 0 or on 1.
    "rollout_async": ("configs/2gpu_rollout.yaml", ()),  # async, eager order (the config's)
    # ... streaming smaller engine calls, two updates of staleness, vLLM generating (its own processes)
    "rollout_async_stream": ("configs/2gpu_rollout.yaml", ("actor.rollout.batch_size=64",)),
    "rollout_async_stale2": ("configs/2gpu_rollout.yaml", ("pipeline.max_staleness=2",)),
    # ... the coordinator on a torch thread per core (its default before 2026-11-30), old logprobs
    # in a pass of their own before each update (`actor.old_logprobs: recompute`, the default before)
    "rollout_async_threads16": ("configs/2gpu_rollout.yaml", ("coordinator.num_threads=16",)),
    "rollout_async_recompute": ("configs/2gpu_rollout.yaml", ("actor.old_logprobs=recompute",)),
    "rollout_async_vllm": ("configs/2gpu_rollout.yaml", ("actor.rollout.backend=vllm",
                                                         "actor.rollout.vllm.gpu_memory_utilization=0.35")),
    # GRPO (no critic; names starting grpo_): generation on GPU 0 against the actor's training on GPU 1
    "grpo_colocated": ("configs/2gpu_colocated.yaml", ()),
    "grpo_rollout_async": ("configs/2gpu_rollout.yaml", ()),
    "grpo_rollout_async_recompute": ("configs/2gpu_rollout.yaml", ("actor.old_logprobs=recompute",)),
    # ... the GPU roles on torch's default CPU threads (a thread per core; their default before
    # 2026-11-30, sixth session) against the one they now get
    "grpo_rollout_async_torch_threads": ("configs/2gpu_rollout.yaml", (f"actor.num_threads={TORCH_THREADS}",)),
    "rollout_async_torch_threads": ("configs/2gpu_rollout.yaml", (f"actor.num_threads={TORCH_THREADS}",
                                                                  f"critic.num_threads={TORCH_THREADS}")),
    "rollout_critic0": ("configs/2gpu_rollout.yaml", ("devices.critic=[0]",)),
    "rollout_critic1": ("configs/2gpu_rollout.yaml", ("devices.critic=[1]",)),
    "rollout_critic1_exact": ("configs/2gpu_rollout.yaml", ("devices.critic=[1]", "pipeline.order=exact")),
    "rollout_critic1_sync": ("configs/2gpu_rollout.yaml", ("devices.critic=[1]", "pipeline.mode=sync")),
    # One node of 8 GPUs (issue 15; run with --shape qwen2-1.5b): every role over all 8, sync, against
    # the compose default map of configs/8gpu.yaml (split, async); on 4 GPUs a scaled-down pair.
    "node8_colocated": ("configs/8gpu.yaml", (*(f"devices.{g}=[0,1,2,3,4,5,6,7]" for g in ("actor", "rollout", "critic")),
                                              "devices.reward=[]", "devices.colocate=[[actor,critic]]",
                                              "pipeline.mode=sync")),
    "node8_split": ("configs/8gpu.yaml", ()),
    "node4_colocated": ("configs/8gpu.yaml", (*(f"devices.{g}=[0,1,2,3]" for g in ("actor", "rollout", "critic")),
                                              "devices.reward=[]", "devices.colocate=[[actor,critic]]",
                                              "pipeline.mode=sync")),
    "node4_split": ("configs/8gpu.yaml", ("devices.actor=[0,1,2]", "devices.rollout=[0]", "devices.reward=[]",
                                          "devices.critic=[3]")),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of medians and GPU busy time")
    p.add_argument("--parts", default="placement,scaling", help="placement (the --runs) and/or scaling (the "
                   "update on one GPU against two): one device call may not fit both")
    p.add_argument("--runs", default=",".join(RUNS), help=f"placement runs, any of {', '.join(RUNS)}")
    p.add_argument("--sharding", default="fsdp,replicate", help="scaling: the two-GPU ways to run the update")
    p.add_argument("--profile-update", type=int, default=0, help="profile this update and this generation of "
                   "each actor worker (actor.profile_updates, actor.rollout.profile_generates) into "
                   "OUT/profiles/<run>/; 0: none")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "model", shape=args.shape)
    params = count_parameters(model)
    runs = Path(tempfile.mkdtemp())
    results: dict = {}

    def save() -> None:  # after every run: a device call cut short still returns what finished
        (out / "placement.json").write_text(json.dumps(results, indent=2))

    def profile(name: str) -> tuple[str, ...]:
        """--profile-update N: the actor's N-th update and N-th generation of each worker profiled."""
        return (f"actor.profile_updates=[{args.profile_update}]", f"actor.rollout.profile_generates=[{args.profile_update}]",
                f"actor.profile_dir={(out / 'profiles' / name).resolve()}") if args.profile_update else ()

    if "placement" in parts:
        for name in args.runs.split(","):
            config, overrides = RUNS[name]
            algorithm = "grpo" if name.startswith("grpo_") else "ppo"
            results[name] = run(algorithm, model, runs, args.steps, params, config=config,
                                overrides=(*overrides, *profile(name)), warmup=args.warmup,
                                until=measured_until(args.steps, args.warmup, args.profile_update))
            traces = out / "traces"  # each run's role calls on a timeline (Perfetto), with NVML busy counters
            traces.mkdir(exist_ok=True)
            shutil.copyfile(Path(results[name]["run_dir"]) / "calls.trace.json", traces / f"{name}.trace.json")
            base = "grpo_colocated" if algorithm == "grpo" else "colocated"
            if base in results and name != base:
                results[name]["over_colocated"] = (results[name]["step_tokens_per_s"]
                                                   / results[base]["step_tokens_per_s"])
            save()
    if "scaling" in parts:
        # The actor's update over two GPUs against one (GRPO: the update phase is the actor's alone),
        # sharded (FSDP2) and replicated: perfect scaling halves the phase (efficiency 1.0).
        until = measured_until(args.steps, 1, args.profile_update)
        one = run("grpo", model, runs, args.steps, params, config="configs/gpu_1x.yaml", overrides=profile("one_gpu"),
                  until=until)
        results["update_scaling"] = {"one_gpu_update_s": one["update_s"]}
        save()
        for sharding in args.sharding.split(","):
            two = run("grpo", model, runs, args.steps, params, config=RUNS["colocated"][0],
                      overrides=(f"actor.sharding={sharding}", *profile(sharding)), until=until)
            results["update_scaling"][sharding] = {"update_s": two["update_s"], "step_s": two["step_s"],
                                                   "efficiency": one["update_s"] / (2 * two["update_s"])}
            save()
    print(json.dumps(results, indent=2), flush=True)


if __name__ == "__main__":
    main()

"""End to end on one GPU: `rolefleet up configs/gpu_1x.yaml` (every role on GPU 0, real processes)
for a few GRPO steps and a few PPO steps with the critic, on a random-weight model of real
dimensions; prints per-phase seconds, generated tokens/s, weight-sync time and the GPU busy
fraction (NVML sampled every 0.2 s while the run trains).

    python benchmarks/gpu_e2e.py --shape qwen2-0.5b --out OUT_DIR
    python benchmarks/gpu_e2e.py --out OUT_DIR --algorithms grpo --steps 12 --warmup 3 --profile 11 [--set actor.compile_layers=false]

With --profile N, medians and GPU busy time stop at step N - 2 (`measured_until`).

The first step of a run includes the static KV cache's compilation; medians are over the later steps.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rolefleet.app.tiny_model import make_tiny_model


class BusySampler(threading.Thread):
    """Mean utilization of each GPU (NVML, percent of time a kernel ran) over the samples taken:
    with `metrics` and `steps`, only while the run trains its later steps (after the record of
    step `warmup`, before the last one's), so start-up, compilation and shutdown do not count."""

    def __init__(self, period_s: float = 0.2, metrics: Path | None = None, steps: int = 0, warmup: int = 1):
        super().__init__(daemon=True)
        self.metrics, self.steps, self.warmup = metrics, steps, warmup
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.period_s, self.samples, self.done = period_s, [], threading.Event()
        self.times: list[float] = []  # wall-clock seconds of each sample
        self.sample_steps: list[int] = []  # ... and the step in progress then (0: no metrics read)

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            if self.metrics is not None and not self.warmup <= self.steps_done() < self.steps:
                continue
            self.samples.append([self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles])
            self.times.append(time.time())
            self.sample_steps.append(self.steps_done() + 1 if self.metrics is not None else 0)

    def steps_done(self) -> int:
        try:
            return self.metrics.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def counter_events(self) -> list[dict]:
        """The samples as Chrome trace counters ("GPU busy %", one series per GPU) on the wall clock
        of a run's calls.trace.json, so that a dip in NVML lines up with the calls around it."""
        meta = {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "NVML"}}
        return [meta] + [{"ph": "C", "name": "GPU busy %", "pid": 0, "ts": round(t * 1e6),
                          "args": {f"gpu{i}": v for i, v in enumerate(sample)}}
                         for t, sample in zip(self.times, self.samples)]

    def busy_per_gpu(self, skip_steps: frozenset[int] = frozenset()) -> list[float]:
        return mean_busy(self.samples, self.sample_steps, skip_steps)

    def busy(self) -> float:
        """GPU 0's (the one-GPU runs)."""
        per_gpu = self.busy_per_gpu()
        return per_gpu[0] if per_gpu else 0.0


def mean_busy(samples: list[list[float]], steps: list[int], skip_steps: frozenset[int] = frozenset()) -> list[float]:
    """Each GPU's mean NVML busy fraction over the samples (percent, one list per sample), leaving
    out those taken while a step of `skip_steps` was in progress (`steps`: each sample's)."""
    kept = [sample for sample, step in zip(samples, steps) if step not in skip_steps]
    return [statistics.mean(col) / 100 for col in zip(*kept)] if kept else []


def _run_to_the_end(cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd` to its end; if this script is stopped first (a time limit's SIGTERM), `rolefleet up`
    is stopped too, and stops its roles: an orphaned run would go on holding the GPUs and skew
    whatever runs on them next."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the `finally` below
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(120)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


PEAK_FLOPS = 790e12  # bf16 dense, H200 (measured 769-798 TFLOP/s on the machine)


def run(algorithm: str, model: Path, out: Path, steps: int, params: int, backend: str = "hf",
        config: str = "configs/gpu_1x.yaml", overrides: tuple[str, ...] = (), warmup: int = 1,
        until: int = 0) -> dict:
    """One `rolefleet up` run; medians and GPU busy time over the steps after the first `warmup`
    (compilation: torch.compile specializes on the first shapes it meets, then on dynamic ones) up to
    step `until` (0: the last)."""
    until = until or steps
    run_dir = out / "-".join([algorithm, backend, Path(config).stem, *overrides]).replace("/", "_")
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", config, f"algorithm={algorithm}",
           f"model.model_name_or_path={model}", f"run.output_dir={run_dir}", f"train.total_steps={steps}",
           f"actor.rollout.backend={backend}", "run.call_trace=true", *overrides]
    sampler = BusySampler(metrics=run_dir / "metrics.jsonl", steps=until, warmup=warmup)
    sampler.start()
    start = time.perf_counter()
    proc = _run_to_the_end(cmd)
    wall = time.perf_counter() - start
    sampler.done.set()
    if proc.returncode != 0:
        raise SystemExit(f"{algorithm}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trace = run_dir / "calls.trace.json"
    if trace.exists():  # the NVML samples beside the calls (the file's format: one event per line)
        with trace.open("a") as f:
            f.writelines(json.dumps(event) + ",\n" for event in sampler.counter_events())
    later = records[warmup:until] or records
    # Updates after the first that recompiled (they or the logprob passes before them): outliers in
    # a window of steps; [role, step, graphs made].
    recompiles = [[role, r["step"], r[f"{role}/compiled_graphs"]] for r in records[1:]
                  for role in ("actor", "critic") if r.get(f"{role}/compiled_graphs")]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in later)

    sequences = 64 * 4
    generated = [r["response_length/mean"] * sequences / r["timing/generate_s"] for r in later]
    return {
        "algorithm": algorithm, "backend": backend, "config": config, "overrides": list(overrides),
        "steps": len(records), "wall_s": wall,
        "gpu_busy": sampler.busy(), "gpu_busy_per_gpu": sampler.busy_per_gpu(),
        # ... without the steps whose update recompiled (seconds of one GPU's compiling, the other idle)
        "gpu_busy_per_gpu_steady": sampler.busy_per_gpu(frozenset(step for _, step, _ in recompiles)),
        "step_s": median("timing/step_s"), "generate_s": median("timing/generate_s"),
        "score_s": median("timing/score_s"), "update_s": median("timing/update_s"),
        "first_step_s": records[0]["timing/step_s"], "generated_tokens_per_s": statistics.median(generated),
        "response_length": median("response_length/mean"), "weight_sync_s": median("actor/weight_sync_s"),
        "step_tokens_per_s": median("throughput/tokens_per_s"),
        "recompiles": recompiles,
        "busy_trace": sampler.samples,  # per sample (0.2 s apart): each GPU's NVML busy percent
        "run_dir": str(run_dir),  # its calls.trace.json: every role call on a timeline (run.call_trace), and NVML
        # Update-phase MFU over the actor's forward + backward of the response tokens alone (the
        # prompts of the addition task are a few tokens), a lower bound: the critic's update shares
        # the phase in PPO.
        "update_mfu": 6 * params * median("response_length/mean") * sequences / median("timing/update_s") / PEAK_FLOPS,
    }


def trl_side_by_side(model: Path, steps: int, grpo: dict) -> dict:
    """The same GRPO workload through TRL's GRPOTrainer; the ratio of generated tokens per second of
    step time (RoleFleet over TRL)."""
    cmd = [sys.executable, str(Path(__file__).with_name("trl_grpo.py")), "--model", str(model), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trl: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    trl = json.loads(proc.stdout.strip().splitlines()[-1])
    later = trl["completion_length"][1:] or trl["completion_length"]
    trl_tokens_per_s = statistics.median(later) * 64 * 4 / trl["trl_step_s"]
    rolefleet_tokens_per_s = grpo["response_length"] * 64 * 4 / grpo["step_s"]
    return {"algorithm": "grpo (TRL GRPOTrainer)", **trl, "trl_tokens_per_s": trl_tokens_per_s,
            "rolefleet_tokens_per_s": rolefleet_tokens_per_s, "ratio": rolefleet_tokens_per_s / trl_tokens_per_s}


def count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for shard in sorted(model_dir.glob("*.safetensors")):  # one file, or a checkpoint's shards
        with safe_open(str(shard), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def measured_until(steps: int, warmup: int, profile: int) -> int:
    """The last step medians count: with a profiled step N, N - 2. The profiler's own cost lands on
    step N, and in async mode on step N - 1 too (its weight sync waits for the profiled generation)."""
    if not profile:
        return steps
    if profile - 2 <= warmup:
        raise SystemExit(f"--profile {profile} leaves no step after the {warmup} of warm-up to measure: "
                         f"profile step {warmup + 3} or later")
    return profile - 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-0.5b", help="random weights of these dimensions (rolefleet tiny-model)")
    p.add_argument("--model", default=None, help="a model directory instead (a real checkpoint; --shape is ignored)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--algorithms", default="grpo,ppo")
    p.add_argument("--backends", default="hf", help="actor.rollout.backend values to run each algorithm with")
    p.add_argument("--trl", action="store_true", help="also run the GRPO workload through TRL (benchmarks/trl_grpo.py)")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of medians and GPU busy time")
    p.add_argument("--profile", type=int, default=0, help="profile this update and this generation of the actor "
                   "(actor.profile_updates, actor.rollout.profile_generates) into OUT/profiles/<algorithm>-<backend>/; 0: none")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else make_tiny_model(Path(tempfile.mkdtemp()) / "model", shape=args.shape)
    runs = Path(tempfile.mkdtemp())  # run outputs (logs, events) stay there; OUT gets the summary
    params = count_parameters(model)

    def overrides(name: str) -> tuple[str, ...]:
        profile = (f"actor.profile_updates=[{args.profile}]", f"actor.rollout.profile_generates=[{args.profile}]",
                   f"actor.profile_dir={(out / 'profiles' / name).resolve()}") if args.profile else ()
        return (*args.set, *profile)

    until = measured_until(args.steps, args.warmup, args.profile)
    results = [run(a, model, runs, args.steps, params, b, overrides=overrides(f"{a}-{b}"), warmup=args.warmup,
                   until=until) for b in args.backends.split(",") for a in args.algorithms.split(",")]
    if args.trl:
        results.append(trl_side_by_side(model, args.steps, next(r for r in results if r["algorithm"] == "grpo")))
    for r in results:
        print(json.dumps(r), flush=True)
    (out / "gpu_e2e.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

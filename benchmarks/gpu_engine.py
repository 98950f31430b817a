"""The actor's engines on one GPU at real model dimensions: Generate (the hf rollout engine, 256
prompts x 256 new tokens, per `actor.rollout.decode`, with the recorded logprobs checked against
recomputes), ComputeLogProbs (policy + reference) and Update (with and without
`actor.compile_layers`), with peak memory, tokens/s and MFU, plus a torch.profiler table of one update.

    python benchmarks/gpu_engine.py --shape qwen2-0.5b --out OUT_DIR

Random weights (`rolefleet tiny-model --shape`), random token ids: the cost of a step depends on the
shapes, not on the values. MFU = 6 x parameters x tokens / time / peak (790 TFLOP/s bf16 on an H200),
the usual estimate that leaves attention out. Results: OUT_DIR/gpu_engine.json and profile_update_*.txt.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import tempfile
import time
from pathlib import Path

import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.rollout_hf import HFRolloutEngine
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.modeling import lm_logprobs

PEAK_FLOPS = 790e12


def random_batch(n: int, prompt: int, response: int, vocab: int, seed: int, ragged: bool = False) -> SequenceBatch:
    """n sequences of random ids; `ragged`: response lengths uniform in [response / 8, response], as
    when rollouts stop at different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(min(100, vocab // 2), vocab, (length,), generator=g)  # noqa: E731
    lengths = torch.randint(response // 8, response + 1, (n,), generator=g).tolist() if ragged else [response] * n
    return SequenceBatch.from_lists([ids(prompt) for _ in range(n)], [ids(r) for r in lengths])


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up, and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def peak_gb(fn) -> float:
    torch.cuda.reset_peak_memory_stats()
    fn()
    return torch.cuda.max_memory_allocated() / 2**30


def bench_generate(core: ActorCore, prompts: list[str], sampling: SamplingParams, decode: str) -> dict:
    core.cfg.rollout.decode = decode
    core.worker.engine = HFRolloutEngine(core.worker.model, core.tokenizer, core.worker.device, core.cfg, core.worker.engine.model.dtype,
                                  core.stop_ids)
    start = time.perf_counter()
    core.generate(prompts, sampling)  # warm-up: graph capture, allocator
    warmup = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    seconds, samples = timed(lambda: core.generate(prompts, sampling), 2)
    made = sum(len(s.response_ids) for s in samples)
    # The recorded logprobs against two recomputes of the same tokens: the engine's own copy (one
    # plain forward: the decode path's own error) and the trainer (bf16 autocast over fp32 weights).
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    recorded = torch.cat([s.logprobs for s in samples])
    with torch.no_grad():
        (engine,) = batch.map_micro_batches(16384, lambda mb: lm_logprobs(
            core.worker.engine.model, mb, core.worker.device, sampling.temperature, 2048, with_entropy=False)[:1])
    trainer = core.compute_logprobs(batch, sampling.temperature, include_reference=False).logprobs
    return {"rollout_decode": decode, "sequences": len(samples), "tokens": made, "seconds": seconds,
            "tokens_per_s": made / seconds, "warmup_s": warmup, "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
            "logprob_vs_engine_forward": {"max": float((recorded - engine.cpu()).abs().max()),
                                          "mean": float((recorded - engine.cpu()).abs().mean())},
            "logprob_vs_trainer": {"max": float((recorded - trainer).abs().max()),
                                   "mean": float((recorded - trainer).abs().mean())}}


def last_json_line(stdout: str) -> dict:
    """The result line of a child benchmark (vLLM logs to stdout too)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def bench_vllm_backend(model_dir: Path, prompts: list[str], sampling: SamplingParams) -> dict:
    """Generate through the vllm backend (RoleFleet's `Generate` path), its weight load, sleep and
    wake, against vLLM alone (`vllm_alone.py`, in its own process) on the same workload."""
    import subprocess
    import sys

    result = {}
    for seeded in (False, True):  # RoleFleet sends a seed per request; vLLM's sampler is slower with one
        alone = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_alone.py")), "--model",
                                str(model_dir), "--gpu-memory-utilization", "0.3", *(["--seeded"] if seeded else [])],
                               capture_output=True, text=True)
        if alone.returncode != 0:
            raise SystemExit(f"vllm_alone: exit {alone.returncode}\n{alone.stderr[-3000:]}")
        result["seeded" if seeded else "unseeded"] = last_json_line(alone.stdout)
    result["vllm_alone_tokens_per_s"] = result["seeded"]["vllm_alone_tokens_per_s"]
    cfg = parse_config({"model": {"model_name_or_path": str(model_dir)}},
                       ["actor.max_tokens_per_request=4194304", "actor.rollout.backend=vllm",
                        "actor.rollout.vllm.gpu_memory_utilization=0.3"])
    core = ActorCore(cfg.actor)
    core.generate(prompts[:8], sampling)  # warm-up
    seconds, samples = timed(lambda: core.generate(prompts, sampling), 3)
    made = sum(len(s.response_ids) for s in samples)
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    diff = (torch.cat([s.logprobs for s in samples]) - core.compute_logprobs(batch, 1.0, False).logprobs).abs()
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    core.worker.engine.sleep()
    sleep_s = time.perf_counter() - start
    free_asleep = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    core.worker.engine.load_weights(core.worker.model.named_parameters())
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    core.worker.engine.wake()
    wake_s = time.perf_counter() - start
    result.update({"backend_tokens_per_s": made / seconds, "tokens": made,
                   "ratio_to_vllm_alone": made / seconds / result["vllm_alone_tokens_per_s"],
                   "logprob_vs_trainer": {"mean": float(diff.mean()), "max": float(diff.max())},
                   "sleep_s": sleep_s, "load_weights_s": load_s, "wake_s": wake_s,
                   "gpu_gb_freed_by_sleep": (free_asleep - free_awake) / 2**30})
    core.worker.engine.sleep()  # its memory back for the hf variants timed next in this process
    return result


def bench_training(core: ActorCore, args, n_params: int, label: str) -> dict:
    """ComputeLogProbs (policy + reference, 256 x (128 + 256) tokens) and Update (64 sequences, one
    optimizer step) at each micro-batch budget."""
    vocab, length = core.vocab_size, args.prompt_tokens + args.response_tokens
    big = random_batch(256, args.prompt_tokens, args.response_tokens, vocab, seed=1)
    seconds, _ = timed(lambda: core.compute_logprobs(big, 1.0, include_reference=True), args.repeats)
    result = {"label": label, "compute_logprobs": {
        "sequences": 256, "tokens": 256 * length, "seconds": seconds, "tokens_per_s": 256 * length / seconds,
        "peak_gb": peak_gb(lambda: core.compute_logprobs(big, 1.0, include_reference=True))}}
    small = random_batch(64, args.prompt_tokens, args.response_tokens, vocab, seed=2)
    old = core.compute_logprobs(small, 1.0, include_reference=False).logprobs
    targets = PolicyTargets(torch.randn(small.num_response_tokens).clamp(-3, 3), old)

    def update():
        return core.update(core.policy_version + 1, core.policy_version, small, targets, 1.0)

    result["update"] = []
    tokens = 64 * length
    for budget in map(int, args.budgets.split(",")):
        core.cfg.max_tokens_per_micro_batch = budget
        seconds, _ = timed(update, args.repeats)
        result["update"].append({
            "max_tokens_per_micro_batch": budget, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "mfu": 6 * n_params * tokens / seconds / PEAK_FLOPS,
            "peak_gb": peak_gb(update)})
        print(label, json.dumps(result["update"][-1]), flush=True)
    best = min(result["update"], key=lambda u: u["seconds"])
    result["update_over_compute_logprobs"] = best["seconds"] / result["compute_logprobs"]["seconds"]
    core.cfg.max_tokens_per_micro_batch = best["max_tokens_per_micro_batch"]

    # Ragged responses (where packing saves the padding): real tokens per second.
    ragged = random_batch(64, args.prompt_tokens, args.response_tokens, vocab, seed=3, ragged=True)
    ragged_targets = PolicyTargets(torch.randn(ragged.num_response_tokens).clamp(-3, 3),
                                   core.compute_logprobs(ragged, 1.0, include_reference=False).logprobs)
    seconds, _ = timed(lambda: core.update(core.policy_version + 1, core.policy_version, ragged, ragged_targets, 1.0),
                       args.repeats)
    real = int((ragged.prompt_lengths + ragged.response_lengths).sum())
    result["update_ragged"] = {"max_tokens_per_micro_batch": best["max_tokens_per_micro_batch"], "tokens": real,
                               "seconds": seconds, "tokens_per_s": real / seconds,
                               "mfu": 6 * n_params * real / seconds / PEAK_FLOPS}
    print(label, "ragged", json.dumps(result["update_ragged"]), flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        update()
        torch.cuda.synchronize()
    Path(args.out, f"profile_update_{label}.txt").write_text(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n"
        + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-0.5b", help="random weights of these dimensions (rolefleet tiny-model)")
    p.add_argument("--model", default=None, help="a model directory instead (a real checkpoint; --shape is ignored)")
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="16384,32768", help="max_tokens_per_micro_batch values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decodes", default="loop,generate", help="actor.rollout.decode kinds to time Generate with")
    p.add_argument("--variants", default="compile_layers=false;compile_layers=true",
                   help="';'-separated actor settings (each ','-separated) to time the engines with")
    p.add_argument("--vllm", action="store_true", help="also time Generate through the vllm backend and vLLM alone")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--response-tokens", type=int, default=256)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = (Path(args.model) if args.model else
                 make_tiny_model(Path(tempfile.mkdtemp()) / "model", shape=args.shape))
    results: dict = {"shape": args.model or args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.vllm:
        rng = random.Random(0)
        prompts = ["".join(rng.choice(string.ascii_lowercase) for _ in range(args.prompt_tokens)) for _ in range(256)]
        results["vllm"] = bench_vllm_backend(model_dir, prompts, SamplingParams(max_new_tokens=args.response_tokens, seed=0))
        print(json.dumps(results["vllm"]), flush=True)
    for i, variant in enumerate(args.variants.split(";")):
        cfg = parse_config({"model": {"model_name_or_path": str(model_dir)}},
                           ["actor.max_tokens_per_request=4194304", "actor.rollout.backend=hf",
                            *(f"actor.{kv}" for kv in variant.split(","))])
        core = ActorCore(cfg.actor)
        n_params = results["params"] = sum(p.numel() for p in core.worker.model.parameters())
        # Generate: 256 prompts x 256 new tokens (random weights rarely stop early: every token is made).
        rng = random.Random(0)
        prompts = ["".join(rng.choice(string.ascii_lowercase) for _ in range(args.prompt_tokens)) for _ in range(256)]
        sampling = SamplingParams(max_new_tokens=args.response_tokens, seed=0)
        for decode in args.decodes.split(",") if i == 0 else ["loop"]:
            results.setdefault("generate", []).append(
                {"variant": variant, **bench_generate(core, prompts, sampling, decode)})
            print(json.dumps(results["generate"][-1]), flush=True)
        label = variant.replace("=", "_").replace(",", "+")
        results.setdefault("training", []).append(bench_training(core, args, n_params, label))
        del core
        torch.cuda.empty_cache()
    (out / "gpu_engine.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The actor's engines on one GPU at real model dimensions: Generate (the hf rollout engine, 256
prompts x 256 new tokens, per KV-cache kind), ComputeLogProbs (policy + reference) and Update, with
peak memory, tokens/s and MFU, plus a torch.profiler table of one update.

    python benchmarks/gpu_engine.py --shape qwen2-0.5b --out OUT_DIR

Random weights (`rolefleet tiny-model --shape`), random token ids: the cost of a step depends on the
shapes, not on the values. MFU = 6 x parameters x tokens / time / peak (790 TFLOP/s bf16 on an H200),
the usual estimate that leaves attention out. Results: OUT_DIR/gpu_engine.json and profile_update.txt.
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
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.tiny_model import make_tiny_model

PEAK_FLOPS = 790e12


def random_batch(n: int, prompt: int, response: int, vocab: int, seed: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(min(100, vocab // 2), vocab, (length,), generator=g)  # noqa: E731
    return SequenceBatch.from_lists([ids(prompt) for _ in range(n)], [ids(response) for _ in range(n)])


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="8192,16384,32768", help="max_tokens_per_micro_batch values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--caches", default="dynamic,static", help="actor.rollout_cache kinds to time Generate with")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--response-tokens", type=int, default=256)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "model", shape=args.shape)
    cfg = parse_config({"model": {"model_name_or_path": str(model_dir)}}, ["actor.max_tokens_per_request=4194304"])
    core = ActorCore(cfg.actor)
    n_params = sum(p.numel() for p in core.model.parameters())
    vocab = core.vocab_size
    results: dict = {"shape": args.shape, "params": n_params, "device": torch.cuda.get_device_name(),
                     "torch": torch.__version__}

    # Generate: 256 prompts x 256 new tokens (random weights rarely stop early: every token is made).
    rng = random.Random(0)
    prompts = ["".join(rng.choice(string.ascii_lowercase) for _ in range(args.prompt_tokens)) for _ in range(256)]
    sampling = SamplingParams(max_new_tokens=args.response_tokens, seed=0)
    results["generate"] = []
    for cache in args.caches.split(","):
        core.cfg.rollout_cache = cache
        start = time.perf_counter()
        core.generate(prompts[:8], sampling)  # warm-up (and, for a static cache, compilation)
        warmup = time.perf_counter() - start
        seconds, samples = timed(lambda: core.generate(prompts, sampling), 1)
        made = sum(len(s.response_ids) for s in samples)
        results["generate"].append({"rollout_cache": cache, "sequences": len(samples), "tokens": made,
                                    "seconds": seconds, "tokens_per_s": made / seconds, "warmup_s": warmup,
                                    "peak_gb": torch.cuda.max_memory_allocated() / 2**30})
        print(json.dumps(results["generate"][-1]), flush=True)
    core.cfg.rollout_cache = "dynamic"

    # ComputeLogProbs, policy + reference, 256 x (128 + 256) tokens.
    length = args.prompt_tokens + args.response_tokens
    big = random_batch(256, args.prompt_tokens, args.response_tokens, vocab, seed=1)
    seconds, _ = timed(lambda: core.compute_logprobs(big, 1.0, include_reference=True), args.repeats)
    results["compute_logprobs"] = {
        "sequences": 256, "tokens": 256 * length, "seconds": seconds, "tokens_per_s": 256 * length / seconds,
        "peak_gb": peak_gb(lambda: core.compute_logprobs(big, 1.0, include_reference=True)),
    }

    # Update on 64 x (128 + 256) tokens, one optimizer step, at several micro-batch budgets.
    small = random_batch(64, args.prompt_tokens, args.response_tokens, vocab, seed=2)
    old = core.compute_logprobs(small, 1.0, include_reference=False).logprobs
    targets = PolicyTargets(torch.randn(small.num_response_tokens).clamp(-3, 3), old)
    step = [0]

    def update():
        step[0] += 1
        return core.update(step[0], core.policy_version, small, targets, 1.0)

    results["update"] = []
    tokens = 64 * length
    for budget in map(int, args.budgets.split(",")):
        core.cfg.max_tokens_per_micro_batch = budget
        seconds, _ = timed(update, args.repeats)
        results["update"].append({
            "max_tokens_per_micro_batch": budget, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "mfu": 6 * n_params * tokens / seconds / PEAK_FLOPS,
            "peak_gb": peak_gb(update),
        })
        print(json.dumps(results["update"][-1]), flush=True)
    results["update_over_compute_logprobs"] = (min(u["seconds"] for u in results["update"])
                                               / results["compute_logprobs"]["seconds"])

    best = min(results["update"], key=lambda u: u["seconds"])
    core.cfg.max_tokens_per_micro_batch = best["max_tokens_per_micro_batch"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        update()
        torch.cuda.synchronize()
    (out / "profile_update.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    (out / "gpu_engine.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

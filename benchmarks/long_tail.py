"""The long tail, side by side on one GPU (docs/benchmarks.md, "The long tail"): a real chat model
(SmolLM2-135M-Instruct, `make real-model`) on `configs/smollm2_arithmetic.yaml`'s task with up to
`--max-new-tokens` (512) new tokens at temperature 1, where most responses end early and a few run
to the cap.

Parts (`--parts`, in this order, each a run of its own):
- `vllm`: vLLM alone generating the first step's batch (its 32 prompts x 8 samples, the same
  tokens, the sampled token's logprob), median of 3 after a warm-up: the tail-bound baseline.
- `decode`: the decode loop's step alone (CUDA graph replays of the real model) at `--rows` rows
  and at each smaller batch that compaction would move them to, over a cache of the prompt plus
  `--max-new-tokens` slots: milliseconds a step, median of 50.
- `full`: GRPO through `rolefleet up` with `actor.rollout.compact=false` (the hf decode loop decodes
  every row until the batch's last one ends), `--steps` steps.
- `sync`: GRPO through `rolefleet up` as it is (hf decode loop, compaction on), `--steps` steps.
- `partial`: the same with `pipeline.partial_rollouts` (`--budget` tokens a step, carried at most
  `--max-staleness` steps).

Each run records the median of its steps' `timing/generate_s` and `timing/step_s` (after
`--warmup`), the GPU's mean utilization over those steps (NVML), the samples it trained on, and the
held-out greedy accuracy before and after (eval at step 0 and at the last step; `--set eval.every=0`
for none). Writes OUT/long_tail.json and prints one JSON
line per part.

    python benchmarks/long_tail.py --model runs/smollm2-135m-instruct --out OUT --parts vllm
    python benchmarks/long_tail.py --model runs/smollm2-135m-instruct --out OUT --parts sync,partial
    python benchmarks/long_tail.py --model runs/smollm2-135m-instruct --out OUT --parts decode,full,sync,partial \
        --max-new-tokens 4096 --budget 512 --set eval.every=0 actor.max_tokens_per_request=4194304
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import CONFIG, gpu_settings  # noqa: E402 - the same workload and GPU settings


def settings(args) -> list[str]:
    return [f"model.model_name_or_path={args.model}", f"train.total_steps={args.steps}",
            f"train.prompts_per_step={args.prompts_per_step}", f"train.samples_per_prompt={args.samples_per_prompt}",
            f"sampling.max_new_tokens={args.max_new_tokens}", f"actor.lr={args.lr}", f"eval.every={args.steps}",
            f"eval.max_prompts={args.eval_prompts}", "checkpoint.at_end=false", *args.set]


def gpu_busy(proc: subprocess.Popen, metrics: Path, first: int, last: int) -> float | None:
    """While `proc` runs: the GPU's mean utilization (NVML, GPU 0, sampled every 50 ms) from when
    the record of step `first` is written to when that of step `last` is: the steps between, without
    the start-up. None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 - no NVML (a CPU machine): nothing to sample
        proc.wait()
        return None
    samples, marks = [], {}
    while proc.poll() is None:
        samples.append((time.perf_counter(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                marks.setdefault(json.loads(line)["step"], time.perf_counter())
        time.sleep(0.05)
    if first not in marks or last not in marks:
        return None
    window = [u for t, u in samples if marks[first] <= t <= marks[last]]
    return statistics.mean(window) / 100 if window else None


def run(args, out: Path, name: str, extra: list[str]) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", CONFIG, *settings(args), *gpu_settings(), *extra,
           f"run.output_dir={run_dir}"]
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        # The steps after the warm-up, up to the one before the last (whose record waits for its evaluation).
        busy = gpu_busy(proc, run_dir / "metrics.jsonl", args.warmup, max(args.warmup + 1, args.steps - 1))
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{(out / f'{name}.log').read_text()[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/step_s" in r]
    later = steps[args.warmup:] or steps
    evals = [r for r in records if "eval/pass@1" in r]
    groups = [r.get("partial/trained_groups", args.prompts_per_step) for r in steps]
    return {
        "part": name, "wall_s": time.perf_counter() - start, "steps": len(steps),
        "generate_s": statistics.median(r["timing/generate_s"] for r in later),
        "step_s": statistics.median(r["timing/step_s"] for r in later),
        "update_s": statistics.median(r["timing/update_s"] for r in later),
        "busy_actor": statistics.median(r.get("busy/actor", 0.0) for r in later),
        "gpu_busy": busy,
        "trained_samples": sum(groups) * args.samples_per_prompt,
        "response_length": statistics.median(r["response_length/mean"] for r in later),
        "clip_ratio": statistics.median(r["response_length/clip_ratio"] for r in later),
        "older_token_frac": statistics.median(r.get("partial/older_token_frac", 0.0) for r in later),
        "max_lag": max(r.get("partial/max_lag", 0.0) for r in steps),
        "eval": [[r["step"], r["eval/pass@1"]] for r in evals],
        "generate_s_per_step": [round(r["timing/generate_s"], 3) for r in steps],
    }


def vllm_alone(args) -> dict:
    """vLLM generating the first step's batch: its prompts as the actor tokenizes them, n samples each."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from rolefleet.common.config import load_config
    from rolefleet.coordinator.data import PromptDataset

    cfg = load_config(CONFIG, settings(args))
    records = PromptDataset.for_run(cfg).batch(1, args.prompts_per_step)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [TokensPrompt(prompt_token_ids=tokenizer(r.prompt)["input_ids"]) for r in records]
    llm = LLM(model=args.model, dtype="bfloat16", gpu_memory_utilization=0.4, generation_config="vllm",
              skip_tokenizer_init=True)
    # The actor's stop: the chat template's end of turn, which the imported model's eos is.
    params = SamplingParams(n=args.samples_per_prompt, temperature=1.0, max_tokens=args.max_new_tokens, logprobs=0,
                            stop_token_ids=[tokenizer.eos_token_id], detokenize=False)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    seconds, lengths = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        lengths = sorted(len(o.token_ids) for out in outputs for o in out.outputs)
    return {"part": "vllm", "generate_s": statistics.median(seconds), "runs_s": seconds,
            "median_length": lengths[len(lengths) // 2], "p93_length": lengths[int(0.93 * len(lengths))],
            "at_cap": sum(n >= args.max_new_tokens for n in lengths) / len(lengths)}


def decode_steps(args) -> dict:
    """Milliseconds of one decode step (a graph replay) at `--rows` rows and at each half of it down
    to the compaction floor (the batches compaction moves rows to when `--rows` is a power of two),
    over the same cache length."""
    import torch
    from transformers import AutoModelForCausalLM

    from rolefleet.actor.decode import COMPACT_FLOOR, SLOT_ROUNDING, DecodeLoop, _Mode, cache_attention_on
    from rolefleet.common.modeling import compile_decoder_layers

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    compile_decoder_layers(model)  # as the engine runs it with `compile_layers`
    loop = DecodeLoop(model, torch.device("cuda"), 0, 32768, compile=True)
    prompt = 64
    length = -(-(prompt + args.max_new_tokens) // SLOT_ROUNDING) * SLOT_ROUNDING  # as the loop rounds it
    mode, result, rows = _Mode(0, False, False), {}, args.rows
    with torch.no_grad(), cache_attention_on(model):
        root = loop._prepare(args.rows, length, mode)
        while rows >= COMPACT_FLOOR:
            buf = root if rows == args.rows else loop._compacted_buffers(root, rows, mode, prompt)
            buf.cache.slot.fill_(prompt)
            times = []
            for _ in range(60):
                torch.cuda.synchronize()
                start = time.perf_counter()
                buf.graph.replay()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                buf.cache.slot.fill_(prompt)  # stay within the cache
            result[rows] = round(1000 * statistics.median(times[10:]), 3)
            rows //= 2
    return {"part": "decode", "cache_slots": length, "step_ms_by_rows": result}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a chat model directory (make real-model)")
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="vllm,sync,partial")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--rows", type=int, default=256, help="rows of the `decode` part's first batch")
    p.add_argument("--budget", type=int, default=64, help="pipeline.partial_rollouts.token_budget")
    p.add_argument("--max-staleness", type=int, default=8, help="pipeline.max_staleness of the partial run")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of both runs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Parts may run in separate invocations (vLLM's engine is best left in a process of its own):
    # each adds to what an earlier one wrote.
    written = out / "long_tail.json"
    results: dict = {**(json.loads(written.read_text()) if written.exists() else {}), "settings": vars(args)}
    parts = args.parts.split(",")
    for part in parts:
        if part == "vllm":
            results[part] = vllm_alone(args)
        elif part == "decode":
            results[part] = decode_steps(args)
        elif part == "full":
            results[part] = run(args, out, "full", ["actor.rollout.compact=false"])
        elif part == "sync":
            results[part] = run(args, out, "sync", [])
        elif part == "partial":
            results[part] = run(args, out, "partial", [
                "pipeline.partial_rollouts.enabled=true", f"pipeline.partial_rollouts.token_budget={args.budget}",
                f"pipeline.max_staleness={args.max_staleness}"])
        else:
            raise SystemExit(f"--parts: unknown part {part!r} (vllm, decode, full, sync, partial)")
        print(json.dumps(results[part]), flush=True)
        written.write_text(json.dumps(results, indent=2))
    for faster, base in (("partial", "vllm"), ("partial", "sync"), ("partial", "full"), ("sync", "full")):
        if faster in results and base in results:
            results[f"generate_speedup_{faster}_vs_{base}"] = results[base]["generate_s"] / results[faster]["generate_s"]
    if any(k.startswith("generate_speedup") for k in results):
        written.write_text(json.dumps(results, indent=2))
        print(json.dumps({k: v for k, v in results.items() if k.startswith("generate_speedup")}), flush=True)


if __name__ == "__main__":
    main()

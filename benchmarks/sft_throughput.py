"""Supervised fine-tuning throughput, side by side with TRL's `SFTTrainer` on the same data and
batch (issue target: recorded on one GPU, docs/benchmarks.md "SFT throughput"). Random weights of
real dimensions (`--shape`, default the 0.5B shape) and synthetic prompt/completion records of
fixed token lengths; both train the completions only, bf16 mixed precision over fp32 weights, AdamW
at the same learning rate, one optimizer step per `--batch` records.

    python benchmarks/sft_throughput.py --out OUT [--shape qwen2-0.5b] [--steps 12] [--batch 32] \\
        [--prompt-tokens 128] [--completion-tokens 384] [--no-trl]

RoleFleet runs `algorithm: sft` through `rolefleet up configs/gpu_1x.yaml` (real role processes; its
checkpoints and evaluation off); TRL runs in this process (trl and datasets are not RoleFleet
dependencies: carried to the GPU machine as wheels). Prints one JSON line per side and writes
OUT/sft_throughput.json: trained (completion) tokens per second of each, the median over the steps
after the first two, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP = 2  # steps left out of the medians (compilation, allocator growth)


def records(tokenizer, n: int, prompt_tokens: int, completion_tokens: int, seed: int = 0) -> list[dict]:
    """Prompt and completion texts of random lowercase words, cut to about the asked token counts
    (any tokenizer: the tiny models' character-level one or a real BPE)."""
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
                         for _ in range(tokens))
        return tokenizer.decode(tokenizer(words, add_special_tokens=False)["input_ids"][:tokens]).strip()

    return [{"prompt": text(prompt_tokens), "completion": text(completion_tokens)} for _ in range(n)]


def rolefleet(args, model: str, data: Path, out: Path) -> dict:
    run_dir = out / "rolefleet"
    cmd = [sys.executable, "-m", "rolefleet.cli", "up", "configs/gpu_1x.yaml", "algorithm=sft",
           f"model.model_name_or_path={model}", "data.task=null", f"data.path={data}", "data.chat_template=false",
           "eval.every=0", f"train.total_steps={args.steps}", f"train.prompts_per_step={args.batch}",
           f"actor.lr={args.lr}", "actor.ppo_epochs=1", "actor.num_mini_batches=1", "checkpoint.every=0",
           "checkpoint.every_minutes=0", "checkpoint.at_end=false", "checkpoint.snapshot.enabled=false",
           f"run.output_dir={run_dir}", *args.set]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rolefleet: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "sft/tokens" in r][WARMUP:]
    return {"tokens_per_s": statistics.median(r["sft/tokens"] / r["timing/step_s"] for r in steps),
            "step_s": statistics.median(r["timing/step_s"] for r in steps), "tokens_per_step": steps[0]["sft/tokens"],
            "peak_memory_gib": max(r.get("actor/peak_memory_gib", 0.0) for r in steps)}


def trl(args, model: str, rows: list[dict], completion_tokens: int) -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Timer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, a, state, control, **kwargs):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            sync()
            self.seconds.append(time.perf_counter() - self.start)

    config = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=args.lr, bf16=torch.cuda.is_available(),
                       per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, logging_steps=1,
                       report_to="none", save_strategy="no", seed=0, completion_only_loss=True, packing=False,
                       max_length=args.prompt_tokens + completion_tokens + 8)
    timer = Timer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    seconds = timer.seconds[WARMUP:]
    # A step's trained tokens: its records' completions and their EOS (as RoleFleet counts them), on average.
    tokenizer = trainer.processing_class
    per_record = statistics.mean(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1
                                 for r in rows)
    tokens = args.batch * per_record
    return {"tokens_per_s": statistics.median(tokens / s for s in seconds), "step_s": statistics.median(seconds),
            "tokens_per_step": tokens, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=384)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of RoleFleet's run")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from rolefleet.app.tiny_model import make_tiny_model

    model = str(make_tiny_model(out / "model", shape=args.shape))
    rows = records(AutoTokenizer.from_pretrained(model), args.steps * args.batch, args.prompt_tokens,
                   args.completion_tokens)
    data = out / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"shape": args.shape, "settings": vars(args), "rolefleet": rolefleet(args, model, data, out)}
    print(json.dumps({"rolefleet": result["rolefleet"]}), flush=True)
    if not args.no_trl:
        result["trl"] = trl(args, model, rows, args.completion_tokens)
        result["speedup"] = result["rolefleet"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
        print(json.dumps({"trl": result["trl"], "speedup": result["speedup"]}), flush=True)
    (out / "sft_throughput.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Packed micro-batches' attention, side by side on one GPU (docs/benchmarks.md, "Packed attention"):
the forward and backward of `lm_logprobs` on one packed micro-batch (`<role>.sequence_packing`)
through sdpa's dense block-diagonal mask and through FlexAttention's block mask
(`common/packed_attention.py`), in bf16 autocast on a model of real dimensions with random weights
(`--shape`, default the 0.5B shape).

For each `--responses` length R: `--sequences` sequences of a 64-token prompt and an R-token
response in one row; milliseconds a pass (median of `--repeats` after a warm-up), the peak memory of
a pass, the largest logprob difference between the two, and the graphs torch.compile made after
the first length (FlexAttention compiles once for every length: it must be none).

    python benchmarks/packed_attention.py --out OUT                      # 0.5B shape, R = 64, 256, 1024, 4096
    python benchmarks/packed_attention.py --out OUT --shape tiny --responses 64 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.modeling import enable_activation_checkpointing, lm_logprobs
from rolefleet.trainer.profiling import compiled_graphs


def one_pass(model, batch, attention: str) -> tuple[torch.Tensor, float, int]:
    cuda = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logprobs, _ = lm_logprobs(model, batch, cuda, 1.0, 4096, False, True, attention=attention)
    logprobs.float().mean().backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return logprobs.detach(), (time.perf_counter() - start) * 1e3, torch.cuda.max_memory_allocated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="qwen2-0.5b")
    parser.add_argument("--responses", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("cuda"):  # seconds on the GPU
        model_dir = make_tiny_model(out / "model", shape=args.shape, dtype=torch.bfloat16)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    enable_activation_checkpointing(model)  # as a long-response update runs
    model.train()
    vocab = model.config.vocab_size
    rows, graphs_after_first = [], None
    for length in args.responses:
        torch.manual_seed(length)
        batch = SequenceBatch.from_lists([torch.randint(3, vocab, (64,)) for _ in range(args.sequences)],
                                         [torch.randint(3, vocab, (length - i,)) for i in range(args.sequences)])
        row = {"response_tokens": length, "tokens": int(batch.prompt_lengths.sum() + batch.response_lengths.sum())}
        results = {}
        for attention in ("sdpa", "flex"):
            try:
                one_pass(model, batch, attention)  # warm-up (flex: its compile, once)
                passes = [one_pass(model, batch, attention) for _ in range(args.repeats)]
            except torch.OutOfMemoryError as e:
                row[attention] = {"error": f"out of memory: {str(e)[:120]}"}
                torch.cuda.empty_cache()
                continue
            results[attention] = passes[0][0]
            row[attention] = {"ms": statistics.median(p[1] for p in passes),
                              "peak_gib": max(p[2] for p in passes) / 2**30}
        if len(results) == 2:
            row["max_abs_logprob_diff"] = float((results["flex"] - results["sdpa"]).abs().max())
            row["speedup"] = row["sdpa"]["ms"] / row["flex"]["ms"]
        if graphs_after_first is None:
            graphs_after_first = compiled_graphs()
        row["graphs_since_first_length"] = compiled_graphs() - graphs_after_first
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "packed_attention.json").write_text(json.dumps({"shape": args.shape, "gpu": torch.cuda.get_device_name(),
                                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

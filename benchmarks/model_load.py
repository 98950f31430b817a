"""Loading a trainer's model: host memory and time, before and after `trainer/loading.py`, on
random weights of real dimensions stored in bf16 (as checkpoints are), each load in a process of
its own so its peaks are its own.

    python benchmarks/model_load.py --out OUT [--shape qwen2.5-7b] [--model-dir DIR]

Variants:
- previous: what every rank did before: the whole model read into host memory in fp32, then moved
  to the GPU (`from_pretrained(dtype=float32)` + `.to`);
- whole: `modeling.load_causal_lm` on the GPU (one trainer on one GPU): tensors stream to the GPU
  and are cast to fp32 there;
- sharded: `trainer.loading` over a one-rank NCCL group: the meta-device skeleton, FSDP2-sharded,
  each tensor's rows read by slice (with more ranks, each reads 1/world of them);
- first-step: `configs/gpu_7b.yaml`'s actor (LoRA) built in-process and one update on a small batch:
  seconds from the process's start to the end of its first optimizer step.

Per variant: seconds, the peak host memory above the resident size before loading (VmHWM: anonymous
and file pages) and its ratio to the checkpoint's bf16 bytes, the anonymous memory left after the
load, and torch's peak GPU allocation; OUT/model_load.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.monotonic()
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def measure(model: str, variant: str, where: str) -> dict:
    import torch
    import torch.distributed as dist

    device = torch.device(where)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()
    Path("/proc/self/clear_refs").write_text("5")  # the imports' peak is not the load's
    before = _status_kib("VmRSS")
    start = time.monotonic()
    if variant == "previous":
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    elif variant == "whole":
        from rolefleet.common.modeling import load_causal_lm

        loaded = load_causal_lm(model, device)
    elif variant == "sharded":
        from transformers import AutoModelForCausalLM

        from rolefleet.common.modeling import decoder_layers
        from rolefleet.trainer.loading import build_on_meta
        from rolefleet.trainer.ranks import Ranks
        from rolefleet.trainer.sharding import shard

        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tempfile.mktemp()}", rank=0,
                                world_size=1)
        skeleton = build_on_meta(AutoModelForCausalLM, model)
        shard(skeleton, decoder_layers(skeleton), device, torch.bfloat16 if cuda else None, Ranks.of(None))
        loaded = skeleton
    elif variant == "first-step":
        return first_step(model, before)
    if cuda:
        torch.cuda.synchronize()
    assert loaded is not None  # held until measured: "anon_after" is what a loaded model keeps in host memory
    return {"seconds": time.monotonic() - start, "host_peak_gib": (_status_kib("VmHWM") - before) / 2**20,
            "anon_after_gib": _status_kib("RssAnon") / 2**20,
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def first_step(model: str, before: int) -> dict:
    import torch

    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.types import PolicyTargets, SamplingParams
    from rolefleet.common.batch import SequenceBatch
    from rolefleet.common.config import load_config

    cfg = load_config(CONFIGS / "gpu_7b.yaml", [f"model.model_name_or_path={model}"])
    core = ActorCore(cfg.actor)
    loaded = time.monotonic() - START
    samples = core.generate(["1+2="] * 16, SamplingParams(max_new_tokens=32, n=1, seed=0))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    lp = core.compute_logprobs(batch, 1.0, include_reference=True)
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
    core.update(1, 0, batch, targets, 1.0)
    torch.cuda.synchronize()
    return {"seconds_to_loaded": loaded, "seconds_to_first_step": time.monotonic() - START,
            "host_peak_gib": (_status_kib("VmHWM") - before) / 2**20,
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--variants", default="previous,whole,sharded,first-step")
    p.add_argument("--model-dir", help="where the random-weight model is built, or found from an earlier call")
    p.add_argument("--timeout", type=float, default=400, help="seconds per variant")
    p.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the script (the GPU figures are the point)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.device)))
        return
    import torch

    from rolefleet.app.tiny_model import make_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model_dir or tempfile.mkdtemp()) / args.shape
    if not (model / "tokenizer_config.json").exists():  # written last: a whole earlier build
        with torch.device(args.device):  # seconds on the GPU at 7B, minutes on the CPU
            make_tiny_model(model, shape=args.shape, dtype=torch.bfloat16)
    checkpoint_gib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
    results = []
    for variant in args.variants.split(","):
        row = {"shape": args.shape, "variant": variant, "checkpoint_gib": checkpoint_gib}
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(out), "--one", str(model), variant,
                                   "--device", args.device],
                                  capture_output=True, text=True, timeout=args.timeout)
            lines = done.stdout.strip().splitlines()
            row.update(json.loads(lines[-1]) if done.returncode == 0 and lines else
                       {"error": done.stderr.strip().splitlines()[-3:]})
        except subprocess.TimeoutExpired:
            row["error"] = f"over {args.timeout} s"
        if "host_peak_gib" in row:
            row["host_peak_over_bf16"] = row["host_peak_gib"] / checkpoint_gib
        print(json.dumps(row), flush=True)
        results.append(row)
        (out / "model_load.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

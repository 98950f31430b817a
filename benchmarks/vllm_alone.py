"""vLLM alone on the Generate workload of `gpu_engine.py`, for the side-by-side ratio: 256 prompts
of random token ids, 256 new tokens (ignore_eos), temperature 1, the sampled token's logprob
(`logprobs=0`), vLLM's defaults otherwise (its engine core in its own process). Prints one JSON line.

    python benchmarks/vllm_alone.py --model MODEL_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--seeded", action="store_true", help="a seed per request, as RoleFleet's Generate sends "
                   "(vLLM then draws each sequence's noise from its own generator)")
    args = p.parse_args()
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=args.gpu_memory_utilization, generation_config="vllm")
    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 1000, (args.prompt_tokens,), generator=g).tolist())
               for _ in range(args.prompts)]
    params = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, logprobs=0, detokenize=False,
                             seed=i if args.seeded else None) for i in range(len(prompts))]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    made = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(json.dumps({"vllm_alone_tokens_per_s": made / statistics.median(seconds), "tokens": made,
                      "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()

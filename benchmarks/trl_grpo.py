"""The GRPO workload of `gpu_e2e.py` through TRL's `GRPOTrainer`, for the side-by-side ratio: 64
prompts x 4 completions x up to 256 new tokens per optimizer step, bf16 mixed precision over fp32
weights, KL to the reference (beta 0.001), lr 1e-6, TRL's default generation (transformers'
`generate` in the training process). Prints one JSON line: seconds of each optimizer step.

    python benchmarks/trl_grpo.py --model MODEL_DIR --steps 4
    python benchmarks/trl_grpo.py --model MODEL_DIR --steps 3 --lora-rank 32 --lora-alpha 64 --micro 16

With `--lora-rank`, peft LoRA adapters on every linear layer (as `configs/gpu_7b.yaml`), the frozen
base in bf16 (as RoleFleet keeps it), TRL's reference being the model with the adapters off.
Needs trl and datasets (not RoleFleet dependencies; carried to the GPU machine as wheels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rolefleet.tasks import make_task


class StepTimer(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []
        self.completion_tokens: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.completion_tokens.append(logs["completions/mean_length"])


def constant_reward(completions, **kwargs) -> list[float]:
    """The scores do not change the cost of a step; RoleFleet's side scores addition answers."""
    return [float(len(c) % 2) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="completions per forward/backward")
    p.add_argument("--lora-rank", type=int, default=0, help="peft LoRA of this rank (0: full-parameter)")
    p.add_argument("--lora-alpha", type=float, default=64)
    p.add_argument("--lr", type=float, default=1e-6)
    args = p.parse_args()
    records = make_task("addition", size=args.prompts_per_step * args.steps, seed=0)
    dataset = Dataset.from_dict({"prompt": [r.prompt for r in records]})
    completions = args.prompts_per_step * args.samples_per_prompt
    micro = min(args.micro, completions)  # completions per forward/backward (TRL materialises [micro, length, vocab] logits)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=args.lr, beta=0.001,
        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
        num_generations=args.samples_per_prompt, max_completion_length=args.max_new_tokens, temperature=1.0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        logging_steps=1, report_to="none", save_strategy="no", shuffle_dataset=False, seed=0,
    )
    timer = StepTimer()
    model, peft_config = args.model, None
    if args.lora_rank:
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=constant_reward, args=config, train_dataset=dataset,
                          callbacks=[timer], peft_config=peft_config)
    trainer.train()
    later = timer.seconds[1:] or timer.seconds
    peak = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None
    print(json.dumps({"trl_step_s": statistics.median(later), "steps": timer.seconds, "peak_reserved_gib": peak,
                      "completion_length": timer.completion_tokens}), flush=True)


if __name__ == "__main__":
    main()

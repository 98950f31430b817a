"""Out of device memory as a clear, recoverable error: RESOURCE_EXHAUSTED naming the phase that ran
out, the memory in use and the settings that lower what the phase needs.

The failed call's tensors are gone once its exception unwinds (a trainer's gradients are dropped at
the start of its next step), cached blocks go back to the device, the role stays SERVING and no
state changed (an update's first optimizer step had not begun; one that fails inside Adam is a
partial update and blocks the role as before), so a smaller request succeeds afterwards.
"""

from __future__ import annotations

import gc
from typing import Optional

import torch

from rolefleet.common.errors import LimitExceeded

# (role, RPC) -> (phase, the settings that lower its memory)
PHASES: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("actor", "Generate"): ("generate", ("actor.rollout.batch_size", "sampling.max_new_tokens",
                                         "actor.rollout.vllm.gpu_memory_utilization (vllm)")),
    ("actor", "ComputeLogProbs"): ("logprobs", ("actor.max_tokens_per_micro_batch", "actor.logprob_chunk_tokens",
                                                "actor.ref_offload=true")),
    ("actor", "Update"): ("update", ("actor.max_tokens_per_micro_batch", "actor.gradient_checkpointing=true",
                                     "actor.logprob_chunk_tokens", "actor.ref_offload=true",
                                     "more GPUs in devices.actor (FSDP shards the model over them)")),
    ("critic", "ComputeValues"): ("values", ("critic.max_tokens_per_micro_batch",)),
    ("critic", "Update"): ("update", ("critic.max_tokens_per_micro_batch", "critic.gradient_checkpointing=true",
                                      "more GPUs in devices.critic (FSDP shards the model over them)")),
    ("reward", "Score"): ("model", ("reward.model_max_tokens_per_batch", "reward.model_dtype")),
}


class OutOfMemory(LimitExceeded):
    """A call that ran out of device memory; `field` names the role and phase."""


def explain(role: str, method: str, exc: torch.OutOfMemoryError) -> OutOfMemory:
    """The OutOfMemory error a servicer answers for `exc`, after giving cached memory back."""
    gc.collect()  # the failed call's frames may still hold tensors through reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    phase, knobs = PHASES.get((role, method), (method, ()))
    lower = f"; lower it with {', '.join(knobs)}" if knobs else ""
    return OutOfMemory(f"{role} {phase}", f"out of device memory{_in_use()}{lower} ({_first_line(exc)})")


def _in_use() -> str:
    if not torch.cuda.is_available():
        return ""
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return (f" on cuda:{device}: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, "
            f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB held by tensors after the failed call")


def _first_line(exc: BaseException) -> Optional[str]:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
